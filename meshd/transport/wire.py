"""Every message on the wire: msgspec Structs, one tagged union per plane (the nouns
they carry, chat turns, jobs, sampling, are :mod:`meshd.domain`'s).

Gossip on PUB/SUB is ``[topic, header]`` (``topic``: the cluster's 8-byte hash, which
SUB filters on); ROUTER/DEALER carry ``[header, *raw]``: msgpack of one message, and
tensors as raw frames beside it, never inside it.

Each socket decodes only its plane's union, once, at the edge (``decode_*``): what
does not fit it (another plane's message too), or passes the socket's limit, is
dropped and counted by the caller.
"""

from __future__ import annotations

import hashlib
from typing import TypeVar

import msgspec

from meshd.crdt.lww import Entry
from meshd.domain.job import Job
from meshd.domain.sampling import Sampling

# The join plane's messages are this module's names too (wire.JoinHello, ...).
from .join_wire import (  # noqa: F401
    MAX_JOIN_FRAME,
    JoinAccepted,
    JoinChallenge,
    JoinConfirm,
    JoinHello,
    JoinIdent,
    JoinMessage,
    JoinPending,
    JoinRefused,
    JoinWho,
)

# So are the weights plane's (wire.SliceAsk, ...).
from .weights_wire import (  # noqa: F401
    MAX_TRANSFER_HEADER,
    ChunkAsk,
    ChunkData,
    SliceAsk,
    SliceOffer,
    SliceRefusal,
    TransferMessage,
)

#: Largest control-plane frame a node accepts (gossip, hello, pulls).
MAX_CONTROL_FRAME = 4 * 1024 * 1024
#: Hard ceiling handed to ZeroMQ (ZMQ_MAXMSGSIZE): a peer sending more is disconnected
#: by libzmq before the bytes reach Python. Between the two limits frames are read,
#: then dropped and counted.
ZMQ_MAX_MSG_SIZE = 4 * MAX_CONTROL_FRAME


def cluster_hash(name: str) -> bytes:
    """8-byte id of a cluster name: the gossip topic and the Bonjour TXT ``c`` value."""
    return hashlib.blake2b(name.encode(), digest_size=8, person=b"meshd-cluster").digest()


class Hello(msgspec.Struct, tag=True, kw_only=True):
    """First request a node sends to a peer's mesh ROUTER: who I am, what I hold."""

    sender: str
    cluster: bytes
    incarnation: str
    #: The sender's own entries (node card, heartbeat) so the peer can reach it at once.
    entries: list[Entry] = []
    #: A fresh challenge: the Welcome's ``proof`` signs it (at most 64 bytes are used).
    nonce: bytes = b""


class Welcome(msgspec.Struct, tag=True, kw_only=True):
    """Reply to Hello: the peer's state, so a joiner catches up at once. A large state
    comes a page at a time: ``more`` says the rest is to be pulled."""

    sender: str
    hlc: int
    entries: list[Entry]
    more: bool = False
    #: The answering process (its card may be older than this answer).
    incarnation: str = ""
    #: The sender's signature of the Hello's nonce (``identity.welcome_payload``).
    proof: bytes = b""


class Delta(msgspec.Struct, tag=True, kw_only=True):
    """Entries that just changed on the sender, published on its PUB socket."""

    sender: str
    entries: list[Entry]


class Digest(msgspec.Struct, tag=True, kw_only=True):
    """Periodic summary of the sender's whole state (per-bucket hashes)."""

    sender: str
    hlc: int
    buckets: list[int]


class Pull(msgspec.Struct, tag=True, kw_only=True):
    """Anti-entropy request: send me your entries in every bucket that differs from mine
    (past the cursor ``after``, bucket and key, when the last reply said ``more``)."""

    sender: str
    buckets: list[int]
    after_bucket: int = -1
    after_key: str = ""


class PullReply(msgspec.Struct, tag=True, kw_only=True):
    """A page of the entries of the differing buckets, stamped with the replier's clock;
    ``more``: ask again from the cursor of the last entry."""

    sender: str
    hlc: int
    entries: list[Entry]
    more: bool = False


class Refused(msgspec.Struct, tag=True, kw_only=True):
    """A typed refusal of a request (wrong cluster, unknown message, ...)."""

    code: str
    message: str


# -- data plane ---------------------------------------------------------------------
#: Largest data-plane frame (a prefill chunk of activations plus header).
MAX_DATA_FRAME = 64 * 1024 * 1024


class Addr(msgspec.Struct, frozen=True, array_like=True):
    """Where a socket of some node is: that node's advertised addresses and a port.

    The receiver picks the address itself (``choose_address``), since which one works
    depends on where it stands, not on where the sender stands.
    """

    node: str
    addresses: list[str]
    port: int


class Generate(msgspec.Struct, tag=True, kw_only=True):
    """API node -> stage 0: start ``job`` on this plan."""

    req: str
    instance: str
    generation: int
    #: Every stage's runner, in order; each runner reads its neighbours from it.
    route: list[Addr]
    #: The API node's data ROUTER, where DataChunks go.
    reply_to: Addr
    job: Job
    #: Tokens already streamed to the client (a replay continues after them).
    resume_tokens: list[int] = []


class Start(msgspec.Struct, kw_only=True):
    """Carried by a request's first Activation: what later stages need to know."""

    route: list[Addr]
    reply_to: Addr
    sampling: Sampling
    n_prompt: int
    #: Tokens already streamed before a replay (the last stage primes its state).
    resume: list[int] = []
    #: An embeddings request (see :class:`Job`).
    embed: bool = False
    #: Stage 0's KV slot for the request. Every stage keeps a finished request's KV
    #: under that slot, and forgets it when stage 0 gives the slot to another request.
    slot: int = -1
    #: The prefix cache: the request starts from the first ``prefix_n`` positions of
    #: the KV kept under slot ``prefix_slot`` (-1: none), which every stage copies.
    prefix_slot: int = -1
    prefix_n: int = 0
    #: Run as on a fresh runner: every stage drops its kept prefixes first (where a
    #: sequence's cells lie in the KV buffer moves its attention's low bits).
    cold: bool = False
    #: The exact mode: every stage sends this request's rows as float32.
    exact: bool = False


#: ``Activation.draft_by``: the request's own text (prompt lookup), or a draft model.
DRAFT_BY_LOOKUP = "lookup"
DRAFT_BY_MODEL = "model"


class Activation(msgspec.Struct, tag=True, kw_only=True):
    """Stage i -> stage i+1: hidden rows at positions [pos, pos + rows); tensor frame beside."""

    req: str
    instance: str
    generation: int
    pos: int
    rows: int
    hidden: int
    dtype: str = "f32"
    start: Start | None = None
    #: Compute seconds of each stage so far for this step (metrics).
    compute: list[float] = []
    #: Draft tokens after the first row's (the rows after it): the last stage
    #: verifies them (speculative decoding). One more than the rows after the first
    #: chains the step: its last draft token is the first row of the step sent next,
    #: before this one comes back (see ``Token.epoch``).
    draft: list[int] = []
    #: Who wrote the draft: ``DRAFT_BY_LOOKUP`` or ``DRAFT_BY_MODEL`` (metrics).
    draft_by: str = ""
    #: Stage 0's count of restarts for the request when it sent the step (see
    #: ``Token.epoch``): the last stage drops a step from before its latest restart.
    epoch: int = 0


class Token(msgspec.Struct, tag=True, kw_only=True):
    """Last stage -> stage 0: the sampled token, to feed at ``pos`` next.

    ``epoch`` counts the tokens that restarted the request's steps. A token that
    bumps it is fed: every step stage 0 sent since is dropped. One that keeps it
    confirms a chained step: its draft held whole, and the step after it (fed
    ``token`` at ``pos``) is already on its way, so stage 0 sends the next one."""

    req: str
    instance: str
    generation: int
    token: int
    pos: int
    epoch: int = 0


class Release(msgspec.Struct, tag=True, kw_only=True):
    """Free a request's KV cache on this stage and pass the word down the chain.

    ``reason`` is ``done`` (finished normally: every stage keeps the request's KV for
    the prefix cache), ``cancel`` (client went away, or an error), or ``prefix_miss``
    (a later stage to stage 0: it lacked the cached prefix the request was to start
    from; stage 0 forgets that prefix and frees the request like a cancel)."""

    req: str
    instance: str
    reason: str = "done"
    #: With ``done``: the positions whose KV the answer holds (drafted rows after
    #: its last token are not), which each stage keeps; -1: all.
    n_kv: int = -1


class Propose(msgspec.Struct, tag=True, kw_only=True):
    """Stage 0 of a target -> the runner of a draft model: after the first ``pos``
    tokens it was sent for ``req`` (unchanged since), the request reads ``tokens``;
    propose the ``k`` tokens the draft model would write next (0: only take them in,
    as at admission, so the first proposal does not wait for the prompt)."""

    req: str
    #: The draft model's instance (the receiving runner's).
    instance: str
    #: The target's instance, echoed in the answer.
    target: str
    pos: int
    tokens: list[int]
    k: int
    reply_to: Addr


class Proposal(msgspec.Struct, tag=True, kw_only=True):
    """A draft model's runner -> stage 0 of the target: ``draft`` continues the
    request's tokens up to ``pos`` (exclusive); the draft runner now holds the first
    ``held`` of the tokens stage 0 sent and drafted (0: it holds none; send all)."""

    req: str
    #: The target's instance.
    instance: str
    pos: int
    draft: list[int]
    held: int


class Usage(msgspec.Struct, frozen=True, array_like=True):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens taken from the prefix cache, not computed again.
    cached_tokens: int = 0
    #: Speculative decoding: tokens drafted, and those of them the model agreed with.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: Of those, the draft model's (the rest are prompt lookup's).
    model_drafted_tokens: int = 0
    model_accepted_tokens: int = 0
    #: Drafted steps that held whole while the step after them was already on its
    #: way (speculation pipelined across the stages).
    chained_steps: int = 0
    #: Of the completion tokens, those of the model's thoughts.
    reasoning_tokens: int = 0


class ChunkError(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Why a request ended without a result. ``code`` is stable, ``message`` is for people."""

    code: str
    message: str
    #: The stage at fault, by its index in the plan (``stage_fault``); -1: none said.
    stage: int = -1


class TopLogprob(msgspec.Struct, array_like=True):
    """One alternative of a sampled token: its id, log-probability and bytes."""

    token: int
    logprob: float
    piece: bytes


class TokenLogprob(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A sampled token's log-probability, bytes and most likely alternatives."""

    token: int
    logprob: float
    piece: bytes = b""
    top: list[TopLogprob] = []


class DataChunk(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Stage -> API node: a piece of a request's output (or its typed error).

    Stage 0 sends one with ``n_prompt`` set once the prompt is tokenized; the last stage
    sends text as it is produced and a final chunk with ``finish_reason`` and ``usage``.
    """

    req: str
    #: The answer's text (a thinking model's thoughts come apart, in ``reasoning``).
    text: str = ""
    tokens: list[int] = []
    n_prompt: int | None = None
    #: On stage 0's acknowledgement: prompt positions taken from the prefix cache.
    n_cached: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    error: ChunkError | None = None
    #: Compute seconds of each stage for the step that made this chunk (metrics).
    compute: list[float] = []
    #: Log-probabilities of ``tokens`` when the request asked for them.
    logprobs: list[TokenLogprob] = []
    #: Stage 0's acknowledgement of a request with tools: how the model writes calls
    #: (``meshd.models.tools.ToolFormat``), so the API node reads them back.
    tool_format: str | None = None
    #: An embeddings request's vector: float32, little-endian, unit length.
    embedding: bytes = b""
    #: The stop string that ended the answer (with ``finish_reason`` "stop").
    stop_sequence: str | None = None
    #: Stage 0's notice to a request waiting for a sequence: its place (1: next) and
    #: the seconds it expects to wait (0: not measured yet); nothing else is set.
    queued: int = 0
    eta_s: float = 0.0
    #: On stage 0's acknowledgement: seconds the request waited for its sequence, and
    #: seconds its admission took (template, tokenizer, seat: meshd.api.firsttoken).
    waited_s: float = 0.0
    admit_s: float = 0.0
    #: The thoughts' text that came with ``tokens`` (the last stage splits them).
    reasoning: str = ""


class DataChunks(msgspec.Struct, tag=True, kw_only=True):
    """Stage -> API node: several requests' DataChunks in one message.

    A runner sends what one pass of its loop produced for one API node together (a
    batched step makes a token for each of its requests): one wake-up of the API node,
    not one per request (see ``meshd.engines.outbox``).
    """

    chunks: list[DataChunk]


def chunks_in(msg: OutputMessage) -> list[DataChunk]:
    """The DataChunks ``msg`` carries (one, or a :class:`DataChunks` batch)."""
    return [msg] if isinstance(msg, DataChunk) else msg.chunks


GossipMessage = Hello | Welcome | Delta | Digest | Pull | PullReply | Refused
#: What a runner's ROUTER takes: a request's start, steps, tokens, releases, drafts.
StageMessage = Generate | Activation | Token | Release | Propose | Proposal
#: What an API node's data ROUTER takes: a request's output.
OutputMessage = DataChunk | DataChunks
#: Any message of the gossip and data planes (what a sender may encode).
Message = GossipMessage | StageMessage | OutputMessage

T = TypeVar("T")
_encoder = msgspec.msgpack.Encoder()
_gossip_decoder = msgspec.msgpack.Decoder(GossipMessage)
_stage_decoder = msgspec.msgpack.Decoder(StageMessage)
_output_decoder = msgspec.msgpack.Decoder(OutputMessage)
_join_decoder = msgspec.msgpack.Decoder(JoinMessage)
_transfer_decoder = msgspec.msgpack.Decoder(TransferMessage)


def encode(msg: Message | JoinMessage | TransferMessage) -> bytes:
    """Encode one message header."""
    return _encoder.encode(msg)


class FrameError(ValueError):
    """A frame was dropped; ``reason`` is the counter it goes to."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _decode(decoder: msgspec.msgpack.Decoder[T], frame: bytes | memoryview, limit: int) -> T:
    if len(frame) > limit:
        raise FrameError("oversized", f"{len(frame)} bytes > {limit}")
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        # ValueError covers UnicodeDecodeError: invalid UTF-8 inside a msgpack string.
        # A message of another plane is malformed here too: its tag is not this union's.
        raise FrameError("malformed", str(e)) from None


def decode_join(frame: bytes | memoryview) -> JoinMessage:
    """Decode one join-port frame, or raise :class:`FrameError`."""
    return _decode(_join_decoder, frame, MAX_JOIN_FRAME)


def decode_transfer(frame: bytes | memoryview) -> TransferMessage:
    """Decode one weights-ROUTER header frame, or raise :class:`FrameError`."""
    return _decode(_transfer_decoder, frame, MAX_TRANSFER_HEADER)


def decode_gossip(frame: bytes | memoryview, limit: int = MAX_CONTROL_FRAME) -> GossipMessage:
    """Decode one gossip-plane header frame, or raise :class:`FrameError`."""
    return _decode(_gossip_decoder, frame, limit)


def decode_stage(frame: bytes | memoryview, limit: int = MAX_DATA_FRAME) -> StageMessage:
    """Decode one header frame sent to a runner, or raise :class:`FrameError`."""
    return _decode(_stage_decoder, frame, limit)


def decode_output(frame: bytes | memoryview, limit: int = MAX_CONTROL_FRAME) -> OutputMessage:
    """Decode one header frame sent to an API node's data ROUTER (or FrameError)."""
    return _decode(_output_decoder, frame, limit)

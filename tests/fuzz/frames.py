"""Hypothesis strategies for ZeroMQ frames, and the oracle that says what a node must do.

Frames come in four kinds, mixed by :func:`header`:

* random bytes, and random msgpack values (valid msgpack, wrong shape);
* dicts tagged with a real or made-up message type and random fields;
* real :mod:`meshd.transport.wire` messages whose content is invalid by construction
  (entries with absurd clocks or forged owners, unknown requests, plan generations,
  instances, bucket counts);
* any of the above, mutated: truncated, bit-flipped, spliced, with bytes inserted.

A mutation can turn an invalid message into a valid one (a far-future clock flipped
into range, say). :func:`harmless` is the oracle the tests consult before sending: a
frame is sent only if no correct node would change its state because of it, so any
change seen afterwards is a bug, not a fuzzer's accident.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from hypothesis import strategies as st

from meshd.crdt.hlc import pack, physical
from meshd.crdt.lww import Entry
from meshd.domain.chat import ChatTurn
from meshd.domain.job import Job
from meshd.domain.sampling import Sampling
from meshd.transport import wire

INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
#: Any int msgpack can carry.
ANY_INT = st.one_of(INT64, UINT64)
SMALL_TEXT = st.text(max_size=24)
TAGS = [
    "Hello", "Welcome", "Delta", "Digest", "Pull", "PullReply", "Refused",
    "Generate", "Activation", "Token", "Release", "DataChunk",
]  # fmt: skip

#: Clocks a node must refuse whatever the key: more than the 60 s drift bound ahead.
_FUTURE_MARGIN_MS = 3_600_000


@dataclass
class Target:
    """What the strategies need to know about the node under test."""

    node_id: str
    topic: bytes
    #: Ids of every node the target knows (the fake peer's included).
    known_ids: list[str]
    instance: str = ""
    generation: int = 1
    hidden: int = 0
    #: Where typed refusals of the runner should go (our own ROUTER).
    sink: wire.Addr | None = None
    #: Node start, wall ms: clocks well before it are below the GC horizon.
    started_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    #: Fixed when the target is made: strategies must not read the clock (hypothesis
    #: replays draws and needs them to depend on its choices only).
    now_ms: int = field(default_factory=lambda: int(time.time() * 1000))


# -- entries -----------------------------------------------------------------------
def _future_hlc(t: Target) -> st.SearchStrategy[int]:
    lo = t.now_ms + _FUTURE_MARGIN_MS
    return st.one_of(
        st.builds(pack, st.integers(lo, lo + 10**9), st.integers(0, 0xFFFF)),
        st.integers(pack(lo, 0), 2**64 - 1),
        st.just(2**64 - 1),
        st.just(2**63 - 1),
    )


def _keys(t: Target) -> st.SearchStrategy[str]:
    ids = st.sampled_from(t.known_ids) | SMALL_TEXT
    return st.one_of(
        st.builds(lambda i: f"node/{i}", ids),
        st.builds(lambda i: f"health/{i}", ids),
        st.builds(lambda i: f"instance/{i}", st.sampled_from([t.instance or "x"]) | SMALL_TEXT),
        st.text(max_size=40),
    )


def entries(t: Target) -> st.SearchStrategy[Entry]:
    """Entries every correct node refuses: absurd clocks, forged owners, stale clocks."""
    value = st.none() | st.binary(max_size=64)
    future = st.builds(Entry, _keys(t), _future_hlc(t), SMALL_TEXT, value)

    @st.composite
    def forged(draw) -> Entry:
        owner = draw(st.sampled_from(t.known_ids) | SMALL_TEXT.filter(lambda s: "/" not in s))
        writer = draw(SMALL_TEXT.filter(lambda w: w != owner))
        kind = draw(st.sampled_from(["node/", "health/"]))
        hlc = draw(st.integers(0, pack(t.now_ms, 0)))
        return Entry(kind + owner, hlc, writer, draw(value))

    # A key no node holds, with a clock before the GC horizon (or negative).
    stale_key = st.builds(lambda s: f"instance/fuzz-{s}", SMALL_TEXT)
    stale_hlc = st.one_of(
        st.integers(-(2**63), -1),
        st.integers(1, pack(t.started_ms - 3_600_000, 0)),
    )
    stale = st.builds(Entry, stale_key, stale_hlc, SMALL_TEXT, value)
    return st.one_of(future, forged(), stale)


# -- messages ------------------------------------------------------------------------
def _addr(t: Target) -> st.SearchStrategy[wire.Addr]:
    ports = st.sampled_from([t.sink.port]) if t.sink else st.integers(1, 65535)
    return st.builds(wire.Addr, node=SMALL_TEXT, addresses=st.just(["127.0.0.1"]), port=ports)


def _sampling() -> st.SearchStrategy[Sampling]:
    return st.builds(
        Sampling,
        temperature=st.floats(allow_nan=True, allow_infinity=True),
        top_p=st.floats(allow_nan=True),
        top_k=INT64,
        seed=st.none() | INT64,
        max_tokens=st.none() | INT64,
        stop=st.lists(SMALL_TEXT, max_size=3),
        ignore_eos=st.booleans(),
    )


def _instance(t: Target) -> st.SearchStrategy[str]:
    return st.sampled_from([t.instance]) | SMALL_TEXT if t.instance else SMALL_TEXT


def _generation(t: Target) -> st.SearchStrategy[int]:
    """Plan generations the target does not hold (and, rarely, the one it holds)."""
    wrong = INT64.filter(lambda g: g != t.generation)
    return st.one_of(wrong, st.sampled_from([t.generation + 1, t.generation - 1, 0]))


def messages(t: Target) -> st.SearchStrategy[wire.Message]:
    """Real wire messages with invalid content for ``t``."""
    ents = st.lists(entries(t), max_size=6)
    buckets = st.lists(ANY_INT, max_size=40)
    cluster = st.sampled_from([t.topic]) | st.binary(min_size=0, max_size=12)
    req = st.text(max_size=20).map(lambda s: f"fuzz-{s}")
    gen = _generation(t)
    start = st.none() | st.builds(
        wire.Start,
        route=st.lists(_addr(t), max_size=3),
        reply_to=_addr(t),
        sampling=_sampling(),
        n_prompt=INT64,
        resume=st.lists(INT64, max_size=4),
    )
    return st.one_of(
        st.builds(wire.Hello, sender=SMALL_TEXT, cluster=cluster, incarnation=SMALL_TEXT,
                  entries=ents),
        st.builds(wire.Welcome, sender=SMALL_TEXT, hlc=ANY_INT, entries=ents),
        st.builds(wire.Delta, sender=SMALL_TEXT, entries=ents),
        st.builds(wire.Digest, sender=SMALL_TEXT | st.sampled_from(t.known_ids), hlc=ANY_INT,
                  buckets=buckets),
        st.builds(wire.Pull, sender=SMALL_TEXT, buckets=buckets),
        st.builds(wire.PullReply, sender=SMALL_TEXT, hlc=ANY_INT, entries=ents),
        st.builds(wire.Refused, code=SMALL_TEXT, message=SMALL_TEXT),
        st.builds(
            wire.Generate, req=req, instance=_instance(t), generation=gen,
            route=st.lists(_addr(t), max_size=3), reply_to=_addr(t),
            job=st.builds(
                Job,
                messages=st.none() | st.lists(st.builds(ChatTurn, SMALL_TEXT, SMALL_TEXT),
                                              max_size=3),
                prompt=st.none() | SMALL_TEXT, sampling=_sampling(),
            ),
            resume_tokens=st.lists(INT64, max_size=4),
        ),
        st.builds(
            wire.Activation, req=req, instance=_instance(t),
            generation=gen | st.sampled_from([t.generation]),
            pos=INT64, rows=INT64, hidden=st.sampled_from([t.hidden]) | INT64,
            dtype=st.sampled_from(["f32", "f16", ""]) | SMALL_TEXT, start=start,
            compute=st.lists(st.floats(), max_size=3),
        ),
        st.builds(wire.Token, req=req, instance=_instance(t),
                  generation=gen | st.sampled_from([t.generation]), token=INT64, pos=INT64),
        st.builds(wire.Release, req=req, instance=_instance(t),
                  reason=st.sampled_from(["done", "cancel"]) | SMALL_TEXT),
        st.builds(
            wire.DataChunk, req=req, text=SMALL_TEXT, tokens=st.lists(INT64, max_size=4),
            n_prompt=st.none() | INT64,
            finish_reason=st.none() | st.sampled_from(["stop", "length"]) | SMALL_TEXT,
            usage=st.none() | st.builds(wire.Usage, INT64, INT64),
            error=st.none() | st.builds(wire.ChunkError, code=SMALL_TEXT, message=SMALL_TEXT),
        ),
    )  # fmt: skip


_msgpack_values = st.recursive(
    st.none() | st.booleans() | ANY_INT | st.floats() | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
    max_leaves=20,
)  # fmt: skip


def _tagged() -> st.SearchStrategy[dict]:
    return st.builds(
        lambda tag, rest: {"type": tag, **rest},
        st.sampled_from(TAGS) | st.text(max_size=10),
        st.dictionaries(
            st.sampled_from(["sender", "entries", "buckets", "hlc", "cluster", "req",
                             "instance", "generation", "route", "reply_to", "text", "token"])
            | st.text(max_size=8),
            _msgpack_values, max_size=6,
        ),
    )  # fmt: skip


@st.composite
def _mutated(draw, base: st.SearchStrategy[bytes]) -> bytes:
    b = bytearray(draw(base))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "splice", "byte"]))
        i = draw(st.integers(0, len(b)))
        if op == "truncate":
            b = b[:i]
        elif op == "flip" and b:
            j = min(i, len(b) - 1)
            b[j] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and b:
            j = min(i, len(b) - 1)
            b[j] = draw(st.sampled_from([0x00, 0xC0, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF, 0x7F]))
        elif op == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del b[i : i + draw(st.integers(1, 8))]
        elif op == "splice":
            b += draw(base)[draw(st.integers(0, 8)) :]
    return bytes(b)


_HEADERS: dict[int, st.SearchStrategy[bytes]] = {}


def _transfer_messages() -> st.SearchStrategy[wire.TransferMessage]:
    """Well-formed weights-ROUTER messages about models, files and slices the node
    does not have: each is answered with a typed refusal, never served."""
    sha = st.text("0123456789abcdef", min_size=0, max_size=64)
    return st.one_of(
        st.builds(wire.SliceAsk, model=SMALL_TEXT, sha256=sha, start=ANY_INT, end=ANY_INT,
                  version=ANY_INT),
        st.builds(wire.ChunkAsk, slice=SMALL_TEXT, index=ANY_INT),
        st.builds(wire.ChunkData, slice=SMALL_TEXT, index=ANY_INT),
        st.builds(wire.SliceOffer, slice=SMALL_TEXT, size=ANY_INT, chunk=ANY_INT),
        st.builds(wire.SliceRefusal, slice=SMALL_TEXT, code=SMALL_TEXT, message=SMALL_TEXT),
    )  # fmt: skip


#: One weights-ROUTER header: transfer messages, whole or mutated, and any other header.
def transfer_header(t: Target) -> st.SearchStrategy[bytes]:
    valid = _transfer_messages().map(wire.encode)
    return st.one_of(valid, valid, _mutated(valid), header(t))


def decoded_transfer(frame: bytes) -> wire.TransferMessage | None:
    """The message the weights ROUTER decodes from ``frame``, or None (dropped)."""
    try:
        return wire.decode_transfer(frame)
    except wire.FrameError:
        return None


def header(t: Target) -> st.SearchStrategy[bytes]:
    """One header frame: valid-but-wrong, malformed, or mutated (built once per target:
    building the strategy costs more than drawing from it)."""
    if id(t) not in _HEADERS:
        _HEADERS[id(t)] = _header(t)
    return _HEADERS[id(t)]


def _header(t: Target) -> st.SearchStrategy[bytes]:
    valid = messages(t).map(wire.encode)
    return st.one_of(
        st.binary(max_size=256),
        _msgpack_values.map(msgspec.msgpack.encode),
        _tagged().map(msgspec.msgpack.encode),
        valid,
        valid,
        _mutated(valid),
        _mutated(_tagged().map(msgspec.msgpack.encode)),
    )


# -- oracle --------------------------------------------------------------------------
#: The decoder each socket runs: each plane takes only its own messages.
DECODERS: dict[str, Callable[[bytes, int], wire.Message]] = {
    "mesh": wire.decode_gossip,
    "sub": wire.decode_gossip,
    "reply": wire.decode_gossip,
    "runner": wire.decode_stage,
    "data": wire.decode_output,
}


def decoded(frame: bytes, socket: str, limit: int = wire.MAX_CONTROL_FRAME) -> wire.Message | None:
    """The message a node decodes from ``frame`` on ``socket``, or None (dropped at
    the edge).

    Anything but FrameError out of the decoder propagates and fails the test: the node
    runs the same decoder (invalid UTF-8 once raised UnicodeDecodeError, which killed
    the data-plane loop and the runners; see test_regressions.py).
    """
    try:
        return DECODERS[socket](frame, limit)
    except wire.FrameError:
        return None


def refused(e: Entry, t: Target) -> bool:
    """Whether every correct node refuses ``e`` before it can touch the state."""
    if physical(e.hlc) - int(time.time() * 1000) > 120_000:
        return True  # clock_drift
    owner_only = e.key.startswith(("node/", "health/"))
    if owner_only and e.key.split("/", 1)[1] != e.writer:
        # foreign_owner: only the owner writes its card and heartbeat; others may only
        # delete them (survivors forget a long-dead node), never the target's own.
        return e.value is not None or e.key.split("/", 1)[1] == t.node_id
    # Old entries for keys the node does not hold are accepted unless their writer was
    # a member when the horizon moved; the fake peer never is.
    return False


def harmless(msg: wire.Message | None, t: Target, socket: str) -> bool:
    """False when a correct node could change its state because of ``msg`` on ``socket``
    (``mesh``, ``sub``, ``reply``, ``data`` or ``runner``)."""
    if msg is None:
        return True
    merged = (
        (socket == "mesh" and isinstance(msg, wire.Hello) and msg.cluster == t.topic)
        or (socket == "sub" and isinstance(msg, wire.Delta))
        or (socket == "reply" and isinstance(msg, wire.Welcome | wire.PullReply))
    )
    if merged:
        return all(refused(e, t) for e in msg.entries)  # type: ignore[union-attr]
    if socket != "runner":
        return True
    if isinstance(msg, wire.Generate):
        # A Generate for the right plan is a real request: not bad input.
        return not (msg.instance == t.instance and msg.generation == t.generation)
    return True

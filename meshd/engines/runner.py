"""A runner: one pipeline stage of one model instance, in its own process.

The node's supervisor starts ``python -m meshd.engines.runner CONFIG_JSON``. The runner
binds a ROUTER on an OS-chosen port, loads its stage and talks to the supervisor over
its stdio (:mod:`meshd.engines.protocol`: events out, commands in; EOF on stdin means
the node is gone: exit). SIGINT is ignored (a Ctrl-C in the node's terminal is the
node's to handle: it drains first); the supervisor stops a runner with SIGTERM.

Data plane (all messages carry the request id and the plan generation):

* stage 0 gets ``Generate``: renders the chat template, tokenizes, checks the context,
  sends the API node a ``DataChunk(n_prompt=...)``, then runs its layers;
* a middle stage gets ``Activation`` (hidden rows in a raw float32 frame) and passes
  its own on;
* the last stage samples, sends text to the API node (``DataChunk``) and the token back
  to stage 0 (``Token``), until the request finishes; then ``Release`` walks the chain.

KV slots are never held forever: a new plan generation frees the requests of older
ones, a request idle for ``request_expiry_s`` is freed (its stage 0 died, so no cancel
can reach this stage), and a cancel for a request this stage does not know is accepted.

Requests in flight are batched: one engine call per step serves every request that
has work, so several streams keep every stage busy. The loop is plain synchronous
Python: compute blocks, and nothing else shares this process.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import zmq

from meshd.logs import configure as configure_logs
from meshd.models.chat import CHATML_TEMPLATE, chat_template_at, render_chat
from meshd.models.folder import folder_sha256
from meshd.models.hashing import file_sha256
from meshd.models.pooling import Pooling, pool, pooling_of
from meshd.models.slicing import slice_gguf
from meshd.models.tools import ToolFormat, forced_call_lark, template_messages, tool_format
from meshd.transport import wire
from meshd.transport.addresses import local_addresses
from meshd.transport.security import (
    HANDSHAKE_EVENTS,
    ClusterKeys,
    HandshakeReporter,
    start_zap,
)
from meshd.transport.sockets import DATA, DealerCache, bind, decode_frame, open_socket
from meshd.transport.tensors import TensorError, decode_rows, encode_rows

from .calibrate import LayerClock, calibrate
from .detok import TextStream
from .draft_model import DraftClient, DraftServer
from .drafting import MAX_NGRAM, MIN_NGRAM, DraftBudget, InFlight, Step, prompt_lookup
from .grammar import (
    Constraint,
    GrammarVocab,
    bounded_strings,
    check_grammar,
    closed_objects,
    lark_grammar,
)
from .outbox import Outbox
from .protocol import (
    Expired,
    Failed,
    GenerationAdopted,
    Listening,
    Load,
    Ready,
    RunnerConfig,
    RunnerEvent,
    SetDraft,
    SetGeneration,
    SetMembers,
    Stop,
    decode_command,
    decode_config,
    encode,
)
from .sampling import MAX_TOP_LOGPROBS, Draw, Sampler, SamplingParams
from .stage import StageInput, StageInputError
from .threads import configure_threads

log = logging.getLogger("meshd.runner")

#: Requests stage 0 queues per KV slot before it refuses more (``overloaded``): the
#: API nodes' own admission keeps far below this; a flood of Generates does not grow it.
MAX_WAITING_PER_SEQ = 8
#: Seconds after loading at which an idle stage times a decode step again.
RETIME_AFTER_S = (5.0, 30.0)

#: Cancelled request ids remembered, so that a request's first activation arriving
#: after its cancel (from another sender, so unordered) is not admitted.
MAX_CANCELLED = 4096


def _tool_dict(t: wire.ToolSpec) -> dict[str, object]:
    return msgspec.to_builtins(t)


def emit(event: RunnerEvent) -> None:
    """One status line for the supervisor."""
    sys.stdout.write(encode(event).decode() + "\n")
    sys.stdout.flush()


def sampling_params(s: wire.Sampling, n_vocab: int) -> SamplingParams:
    """The sampler's parameters for a request's sampling; ValueError names what is
    wrong (a value out of range, a biased token past the vocabulary of ``n_vocab``)."""
    bad = [t for t in s.logit_bias if not 0 <= t < n_vocab]
    if bad:
        raise ValueError(f"logit_bias names token {bad[0]}; the vocabulary has {n_vocab}")
    if s.logprobs is not None and not 0 <= s.logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {s.logprobs}")
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repeat_penalty=s.repeat_penalty, repeat_last_n=s.repeat_last_n,
        logit_bias=s.logit_bias, seed=s.seed,
    )  # fmt: skip


@dataclass
class Request:
    """A request's state on this stage."""

    req: str
    seq: int
    route: list[wire.Addr]
    reply_to: wire.Addr
    sampling: wire.Sampling
    n_prompt: int = 0
    n_generated: int = 0
    #: An embeddings request: the last stage pools, nothing is sampled.
    embed: bool = False
    #: Plan generation the request was admitted under.
    generation: int = 0
    #: Stage 0's KV slot for it (what the prefix cache keeps it under everywhere).
    slot: int = -1
    #: Stage 0: the tokens whose KV its sequence holds (prompt, then each token fed
    #: back), which the prefix cache matches new prompts against.
    tokens: list[int] | None = None
    #: Prompt positions taken from the prefix cache, and the slot they came from.
    n_cached: int = 0
    source: int = -1
    #: The key of its last prompt step (see _prefill_key); None once it can share
    #: no more (it started from a cached prefix, or a step ran unkeyed).
    lineage: bytes | None = b""
    #: Stage 0: how many tokens to draft (None: it does not speculate), and its
    #: steps that have not come back.
    budget: DraftBudget | None = None
    flight: InFlight = field(default_factory=InFlight)
    #: Stage 0 and last stage: restarts of its steps so far (``wire.Token.epoch``).
    epoch: int = 0
    #: time.perf_counter() when its last token was fed (0: none yet).
    fed_at: float = 0.0
    #: It has drafted: a step may come back to an earlier position (the rejected
    #: rows' KV is dropped then, on every stage).
    spec: bool = False
    #: Last stage: draft tokens verified, and accepted.
    n_drafted: int = 0
    n_accepted: int = 0
    #: Of those, the draft model's.
    n_model_drafted: int = 0
    n_model_accepted: int = 0
    #: Chained steps held whole (``wire.Usage.chained_steps``).
    n_chained: int = 0
    #: time.monotonic() of the last message or compute for this request.
    last_active: float = field(default_factory=time.monotonic)
    # Last stage only:
    #: A replay's first position to sample after (prompt + tokens already sent).
    replay_end: int = 0
    sampler: Sampler | None = None
    text: TextStream | None = None
    #: The grammar the output must follow (structured outputs, forced tool calls).
    constraint: Constraint | None = None


#: Prefills a stage remembers for choices of the same prompt that come after.
MAX_SHARED_PREFILLS = 16
#: Largest output kept for them (hidden rows of a long prompt on a wide model).
MAX_SHARED_OUTPUT = 64 * 1024 * 1024


#: Fewest positions worth taking from the prefix cache: below it a request computes
#: its whole prompt (a few rows cost less than disturbing a cached sequence).
MIN_PREFIX = 8


@dataclass
class Kept:
    """A finished request's KV, kept on its sequence for a later request whose tokens
    begin the same way. Stage 0 knows the tokens; the other stages follow its word."""

    seq: int
    tokens: list[int] | None = None
    #: The stage's :attr:`Runner.rows_run` when it was kept or last reused.
    rows_at: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


@dataclass
class Prefill:
    """A prompt step this stage ran: its output, the positions its KV holds after it
    (``n``), and the requests whose KV holds them (the one that ran it, then those
    that shared it), any of which can serve another request with the very same steps
    while it lives."""

    holders: list[str]
    n: int
    out: np.ndarray


def _rows(w: Work) -> int:
    return len(w.tokens) if w.tokens is not None else len(w.hidden)  # type: ignore[arg-type]


def _prefill_key(w: Work, lineage: bytes) -> bytes:
    """A digest of a prompt step's input (token ids, or the hidden rows of the stage
    before) and of every step before it (``lineage``: the key of the request's last
    step). Equal keys mean equal KV so far: choices of one prompt give identical bytes
    at every stage, since a shared step sends its leader's very rows on."""
    x = np.ascontiguousarray(w.tokens if w.tokens is not None else w.hidden)
    h = hashlib.blake2b(digest_size=16)
    h.update(lineage)
    h.update(f"{w.pos}{x.dtype.str}{x.shape}".encode())
    h.update(memoryview(x).cast("B"))
    return h.digest()


@dataclass
class Work:
    """One unit of compute for one request: tokens (stage 0) or hidden rows."""

    req: str
    pos: int
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    start: wire.Start | None = None
    #: Compute seconds of the stages before this one, for this step.
    compute: list[float] = field(default_factory=list)
    #: Draft tokens riding with the step's first token (its rows after the first):
    #: the last stage verifies them (speculative decoding).
    draft: list[int] = field(default_factory=list)
    #: Who wrote the draft (``wire.DRAFT_BY_LOOKUP`` / ``DRAFT_BY_MODEL``).
    draft_by: str = ""
    #: The request's epoch at stage 0 when it was sent (``wire.Token.epoch``).
    epoch: int = 0


@dataclass
class Counters:
    """What a runner refused or freed on its own, by reason."""

    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Requests freed after ``request_expiry_s`` without activity.
    expired: int = 0
    #: Requests freed because the plan generation moved on.
    superseded: int = 0
    #: Prefills taken from another request with the same input (Stage.share).
    shared_prefills: int = 0
    #: Requests that started from a kept prefix, and the positions they took from it.
    prefix_hits: int = 0
    prefix_tokens: int = 0
    #: Kept prefixes dropped for going unused too long (``age_kept``).
    prefixes_aged: int = 0
    #: Steps dropped unrun: sent before a restart of their request (``wire.Token``).
    stale_steps: int = 0

    def drop(self, reason: str) -> None:
        """Count one frame dropped for ``reason``."""
        self.dropped[reason] += 1


class Runner:
    """The message loop around one engine stage."""

    def __init__(
        self,
        cfg: RunnerConfig,
        stage,
        ctx: zmq.Context,
        router: zmq.Socket,
        template: str | None = None,
        keys: ClusterKeys | None = None,
    ) -> None:
        self.cfg = cfg
        self.keys = keys
        self.stage = stage
        self.first = cfg.stage == 0
        self.last = cfg.stage == cfg.n_stages - 1
        self.generation = cfg.generation
        self.ctx = ctx
        self.router = router
        self.reqs: dict[str, Request] = {}
        #: Milliseconds per layer of the decode steps this stage runs (placement's
        #: speed figure, sent with every Load report).
        self.clock = LayerClock(cfg.end - cfg.start)
        self.free_seqs = list(range(cfg.n_seq_max - 1, -1, -1))
        #: The prefix cache: finished requests' KV by stage 0's slot, least recently
        #: used first. A kept sequence is not free, but any admission may take it.
        self.kept: collections.OrderedDict[int, Kept] = collections.OrderedDict()
        #: Rows this stage has computed, the clock kept prefixes age by.
        self.rows_run = 0
        # Later stages count a request's rows a little after stage 0 does, and must
        # not drop a prefix stage 0 still counts on (a prefix_miss costs a replay).
        # Where kept KV slows no one (None, 0), only room evicts it.
        rows = cfg.kept_prefix_rows
        if rows is None:
            rows = getattr(stage, "kept_rows", None)
        self.kept_rows = rows * (2 if self.first else 3) // 2 if rows else None
        self.prefills: collections.OrderedDict[bytes, Prefill] = collections.OrderedDict()
        self.waiting: collections.deque[wire.Generate] = collections.deque()
        #: Recently cancelled ids this stage did not hold (oldest first).
        self.cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.work: collections.deque[Work] = collections.deque()
        self.dealers = DealerCache(ctx, keys=keys, own_addresses=local_addresses())
        #: Where DataChunks go: a request's tokens coalesce while they come fast.
        self.outbox = Outbox(self.send, cfg.stream_interval_s)
        self.counters = Counters()
        self.template = template
        # What chat templates get as bos_token / eos_token: the model's own token text,
        # as llama-cpp-python and transformers pass them (stage 0 renders templates).
        texts = getattr(stage, "special_texts", None) if self.first else None
        self.bos_text, self.eos_text = texts() if texts is not None else ("", "")
        self.eos: set[int] = set(stage.eos_tokens()) if self.last else set()
        self._grammar_vocab: GrammarVocab | None = None
        self.expiry = cfg.request_expiry_s
        #: Tokens one request may span: the runner's KV room per request, but never
        #: past what the model was trained for (positions beyond it are garbage).
        self.n_ctx = min(cfg.n_ctx, getattr(stage, "n_ctx_train", 0) or cfg.n_ctx)
        # Checked a few times per expiry, at most once a second: a scan is O(requests).
        self._expiry_every = min(1.0, max(0.01, self.expiry / 4))
        self._next_expiry_check = (
            time.monotonic() + self._expiry_every if self.expiry > 0 else float("inf")
        )
        #: When to time a decode step again while idle: the timing at load ran beside
        #: other stages loading on the same cores (see :meth:`retime`).
        self._retime_at = [time.monotonic() + t for t in RETIME_AFTER_S]
        #: Stage 0: drafts from a draft model's runner, when the node names one.
        self.drafts = DraftClient(cfg.instance, self.send)
        #: A whole-model stage: drafts for other models' requests (it may be a draft
        #: model; see meshd.engines.draft_model).
        self.draft_server = (
            DraftServer(stage, self.n_ctx, self._take_seq, self.free_seqs.append, self.send)
            if self.first and self.last and getattr(stage, "generative", True)
            else None
        )

    # -- sockets -------------------------------------------------------------------
    def send(self, addr: wire.Addr, msg: wire.Message, *frames) -> None:
        d = self.dealers.to(addr)
        try:
            d.send_multipart([wire.encode(msg), *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.counters.dropped["send_queue_full"] += 1

    def chunk(self, r: Request | None, reply_to: wire.Addr, req: str, **kw) -> None:
        self.outbox.put(reply_to, wire.DataChunk(req=req, **kw))

    def fail(self, reply_to: wire.Addr, req: str, code: str, message: str) -> None:
        log.info("request %s ends at stage %d: %s: %s", req, self.cfg.stage, code, message,
                 extra={"req": req})  # fmt: skip
        self.outbox.put(
            reply_to, wire.DataChunk(req=req, error=wire.ChunkError(code=code, message=message))
        )

    # -- loop ----------------------------------------------------------------------
    def serve(self, stdin: StdinLines, members: set[bytes] | None = None) -> None:
        """Serve until the node closes stdin or says ``stop``. ``members``: the client
        keys the ZAP handler admits, replaced in place on a ``members`` command."""
        self.stdin = stdin
        self.members = members
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(stdin.fd, zmq.POLLIN)
        mon = None
        if self.keys is not None:
            mon = self.router.get_monitor_socket(HANDSHAKE_EVENTS)
            poller.register(mon, zmq.POLLIN)
            reporter = HandshakeReporter(lambda _s, reason: self.counters.dropped.update([reason]))
        if not self.control(stdin.buffered()):
            self.outbox.flush()
            return
        while True:
            events = dict(poller.poll(self._poll_ms()))
            if self.router in events:
                self.drain()
                self.outbox.flush()  # acknowledgements and errors: not after a step
            if self.draft_server is not None:
                if self.draft_server.asks:
                    self.draft_server.run()  # before this stage's own step: a pipeline waits
                self.draft_server.report(self.report_load)
            if self.drafts.pending:
                self.run_undrafted(time.monotonic())
            if mon is not None and mon in events:
                reporter.event("stage", mon.recv_multipart())
            if stdin.fd in events and not self.control():
                self.outbox.flush()
                return
            if self.work:
                self.step()
            self.outbox.flush()
            now = time.monotonic()
            if now >= self._next_expiry_check:
                self._next_expiry_check = now + self._expiry_every
                self.expire(now)
            if self._retime_at and now >= self._retime_at[0]:
                self.retime()

    def _poll_ms(self) -> int:
        """How long the loop may sleep: not at all with work queued, else until the
        first step waiting for a draft gives up on it or held output is due (or 200 ms)."""
        if self.work:
            return 0
        dues = [d for d in (self.drafts.next_deadline(), self.outbox.next_due()) if d is not None]
        if not dues:
            return 200
        return max(0, min(200, int((min(dues) - time.monotonic()) * 1000) + 1))

    def retime(self) -> None:
        """Time a decode step again if the stage is idle and nothing it ran has been
        timed yet; the least of the figures is kept (a machine's speed, not the
        moment's)."""
        self._retime_at.pop(0)
        if self.reqs or self.work or not self.free_seqs or self.clock.steps:
            return
        try:
            ms = calibrate(self.stage, self.cfg.end - self.cfg.start, self.free_seqs[-1])
        except Exception:
            log.debug("could not time a decode step", exc_info=True)
            return
        if ms > 0 and (self.clock.ms <= 0 or ms < self.clock.ms):
            self.clock.ms = self.clock.reported = ms
            self.report_load()

    def control(self, lines: list[bytes] | None = None) -> bool:
        """Handle the commands waiting on stdin (or ``lines``, already read); False when
        the node closed stdin (it is gone) or said ``stop``."""
        if lines is None:
            lines = self.stdin.read()
        if lines is None:
            return False
        for line in lines:
            cmd = decode_command(line)
            if isinstance(cmd, SetGeneration):
                self.set_generation(cmd.value)
            elif isinstance(cmd, SetMembers) and self.members is not None:
                # One set, changed in place: the ZAP thread reads it (a set's updates
                # are atomic under the GIL), and it never sees it empty by mistake.
                new = {k.encode() for k in cmd.keys}
                self.members.intersection_update(new)
                self.members.update(new)
            elif isinstance(cmd, SetDraft):
                self.drafts.set(cmd.instance, cmd.addr)
            elif isinstance(cmd, Stop):
                return False
        return True

    def set_generation(self, generation: int) -> None:
        """Adopt a new plan generation and free every request of another one.

        Their pipelines are gone (a repair replaced a stage) or will be refused at the
        next hop anyway; waiting for them would hold their KV forever when the stage
        that should cancel them died. Each stage hears the new generation from its
        own node, so nothing is forwarded.
        """
        self.generation = generation
        emit(GenerationAdopted(value=generation))
        # A stage of the new plan may be new: it holds none of the kept prefixes.
        self.drop_all_kept()
        stale = [r for r in self.reqs.values() if r.generation != generation]
        for r in stale:
            self.fail(r.reply_to, r.req, "generation_mismatch", "plan changed during the request")
            self.free(r)
        if stale:
            self.counters.superseded += len(stale)
            log.info("plan generation %d: freed %d older request(s)", generation, len(stale))
        queued = [g for g in self.waiting if g.generation != generation]
        for g in queued:
            self.waiting.remove(g)
            self.refuse_generation(g)
        self.admit_waiting()

    def expire(self, now: float) -> None:
        """Free requests idle for longer than ``request_expiry_s``.

        A request is idle when no message for it arrived and none of its work ran: the
        stages before it are gone (a dead stage 0 cannot send the cancel that would
        free this one) or the API node left without a cancel reaching here. A request
        with work still queued is busy, not idle.
        """
        busy = {w.req for w in self.work}
        idle = [
            r for r in self.reqs.values()
            if now - r.last_active > self.expiry and r.req not in busy
        ]  # fmt: skip
        for r in idle:
            self.counters.expired += 1
            log.warning(
                "request %s idle for %.0f s on stage %d: freed (%d expired so far)",
                r.req, now - r.last_active, self.cfg.stage, self.counters.expired,
            )  # fmt: skip
            emit(Expired(req=r.req, total=self.counters.expired))
            self.fail(
                r.reply_to, r.req, "timeout",
                f"request idle for {self.expiry:g} s on stage {self.cfg.stage}; freed",
            )  # fmt: skip
            # "cancel" walks on: the stages after this one hold the same dead request.
            self.release(r.req, "cancel")
        if self.draft_server is not None:
            self.draft_server.expire(now, self.expiry)

    def drain(self) -> None:
        # Ask the socket whether input waits rather than catch zmq.Again: the exception
        # cost showed on every hop's profile.
        router = self.router
        while router.get(zmq.EVENTS) & zmq.POLLIN:
            frames = router.recv_multipart(copy=False)
            if len(frames) < 2:
                self.counters.dropped["shape"] += 1
                continue
            msg = decode_frame(frames[1].buffer, self.counters.drop, wire.MAX_DATA_FRAME)
            if msg is None:
                continue
            try:
                self.handle(msg, frames[2:])
            except Exception:
                log.exception("error handling %s", type(msg).__name__)
                self.counters.dropped["error"] += 1

    def handle(self, msg: wire.Message, raw: list) -> None:
        if isinstance(msg, wire.Generate):
            if msg.instance != self.cfg.instance or not self.first:
                self.fail(
                    msg.reply_to,
                    msg.req,
                    "wrong_stage",
                    "this runner is not stage 0 of the instance",
                )
            elif msg.generation != self.generation:
                self.refuse_generation(msg)
            elif msg.req in self.cancelled:
                self.counters.dropped["cancelled"] += 1
            elif self.has_room():
                self.admit(self.capped(msg))
            elif len(self.waiting) >= MAX_WAITING_PER_SEQ * self.cfg.n_seq_max:
                self.fail(msg.reply_to, msg.req, "overloaded", "stage 0 has too many queued")
            else:
                self.waiting.append(self.capped(msg))
        elif isinstance(msg, wire.Activation):
            self.on_activation(msg, raw)
        elif isinstance(msg, wire.Token):
            if msg.generation != self.generation:
                self.counters.dropped["generation_mismatch"] += 1
                r = self.reqs.get(msg.req)
                if r is not None:
                    self.fail(
                        r.reply_to, r.req, "generation_mismatch", "plan changed during the request"
                    )
                    self.release(msg.req, "cancel")
                return
            r = self.reqs.get(msg.req)
            if r is not None:
                r.last_active = time.monotonic()
                self.on_token(r, msg)
            else:
                self.counters.dropped["unknown_request"] += 1
        elif isinstance(msg, wire.Release):
            if msg.instance != self.cfg.instance:
                # A target's stage 0 done with a request this runner drafted for.
                if self.draft_server is not None and self.draft_server.release(msg.req):
                    self.admit_waiting()
                return
            self.release(msg.req, msg.reason, msg.n_kv)
        elif isinstance(msg, wire.Propose):
            if self.draft_server is None or msg.instance != self.cfg.instance:
                self.counters.dropped["wrong_stage"] += 1
            else:
                self.draft_server.ask(msg)
        elif isinstance(msg, wire.Proposal):
            self.on_proposal(msg)
        else:
            self.counters.dropped["unexpected"] += 1

    def capped(self, g: wire.Generate) -> wire.Generate:
        """``g`` with ``max_tokens`` within this runner's cap (a request from any
        member must not hold a slot for longer than the node allows)."""
        cap = self.cfg.max_tokens
        if cap is None:
            return g
        mt = g.sampling.max_tokens
        if mt is not None and mt <= cap:
            return g
        return msgspec.structs.replace(
            g, sampling=msgspec.structs.replace(g.sampling, max_tokens=cap)
        )

    def refuse_generation(self, g: wire.Generate) -> None:
        """End ``g`` with a typed error: it names another plan generation."""
        self.fail(
            g.reply_to, g.req, "generation_mismatch",
            f"plan generation {g.generation} != runner generation {self.generation}",
        )  # fmt: skip

    def report_load(self) -> None:
        """Tell the supervisor how many requests hold KV here (it shows in the heartbeat)."""
        ds = self.draft_server
        emit(Load(active=len(self.reqs), layer_ms=round(self.clock.ms, 4),
                  proposed=ds.proposed if ds is not None else 0))  # fmt: skip

    # -- stage 0 -------------------------------------------------------------------
    def admit(self, g: wire.Generate) -> None:
        if not g.embed and not self.stage.generative:
            self.fail(
                g.reply_to, g.req, "not_generative",
                "this model is an embedding model: it embeds, it does not generate",
            )  # fmt: skip
            return
        try:
            sampling_params(g.sampling, self.stage.n_vocab)
            g = self.with_tool_grammar(g)
        except ValueError as e:
            self.fail(g.reply_to, g.req, "bad_sampling", str(e))
            return
        try:
            prompt = self.tokenize(g)
        except Exception as e:
            self.fail(g.reply_to, g.req, "bad_prompt", f"cannot tokenize the prompt: {e}")
            return
        n = len(prompt)
        if n == 0:
            self.fail(g.reply_to, g.req, "bad_prompt", "the prompt is empty")
            return
        if g.count_only:
            # Counted, not run: nothing is allocated, so nothing needs releasing.
            usage = wire.Usage(n, 0)
            self.chunk(None, g.reply_to, g.req, n_prompt=n, finish_reason="stop", usage=usage)
            return
        # A replay re-prefills the prompt plus the tokens the client already has.
        resume = list(g.resume_tokens)
        total = n + len(resume)
        if total >= self.n_ctx:
            self.fail(
                g.reply_to, g.req, "context_length_exceeded",
                f"this model's context is {self.n_ctx} tokens; the prompt has {total}",
            )  # fmt: skip
            return
        # A reused prefix moves the low bits of the logits (the engine sums a batch of
        # rows in another order than the batches that made the prefix: up to ~0.5 on a
        # quantized model), so only requests whose answer is random anyway use it
        # unless they ask: a greedy or seeded one gives the same answer whatever ran
        # before, and a replay's tokens continue exactly.
        reuse = g.cache_prompt
        if reuse is None:
            reuse = g.sampling.temperature > 0 and g.sampling.seed is None
        reuse = reuse and not resume and not g.embed
        # Where a sequence's cells lie in the shared KV buffer moves them too (by ~0.8
        # when kept sequences push them past a 256-cell boundary): a request that
        # reuses nothing runs as on a fresh runner, every stage's kept prefixes dropped.
        cold = not reuse and not g.embed
        if cold:
            self.drop_all_kept()
        seq, source, n_cached = self.seat_first(prompt if reuse else None)
        r = Request(
            g.req, seq, list(g.route), g.reply_to, g.sampling, n_prompt=n,
            generation=g.generation, embed=g.embed, slot=seq, n_cached=n_cached, source=source,
            tokens=None if g.embed else [*prompt, *resume],
        )  # fmt: skip
        speculate = self.cfg.speculate if g.speculate is None else g.speculate
        if speculate is None:
            # Where a trip between nodes sets the pace (a split), for requests whose
            # answer is random anyway (a verified batch of rows sums in another order
            # than one row a step). On one node the draft's extra rows cost about
            # what they save (bench/speculate.py: 0.93-0.96x on the default model).
            speculate = (
                self.cfg.n_stages > 1 and g.sampling.temperature > 0 and g.sampling.seed is None
            )
        if speculate and not g.embed and self.cfg.draft_max > 0:
            r.budget = DraftBudget(self.cfg.draft_max)
            assert r.tokens is not None
            self.drafts.prime(g.req, r.tokens, r.route[0])
        self.reqs[g.req] = r
        self.report_load()
        fmt = self.tool_format if g.tools else None
        self.chunk(r, g.reply_to, g.req, n_prompt=n, tool_format=fmt, n_cached=n_cached)
        start = wire.Start(
            route=r.route, reply_to=r.reply_to, sampling=r.sampling, n_prompt=n, resume=resume,
            embed=g.embed, slot=seq, prefix_slot=source, prefix_n=n_cached, cold=cold,
        )  # fmt: skip
        if self.last and not g.embed:
            try:
                self.init_last(r, resume)
            except ValueError as e:  # a grammar the vocabulary cannot follow
                self.fail(r.reply_to, r.req, "bad_sampling", str(e))
                self.release(r.req, "cancel")
                return
        ids = np.asarray(prompt[n_cached:], np.int32)
        self.work.append(Work(g.req, n_cached, tokens=ids, start=start))
        # The tokens already sent go through one decode step each, as they did the first
        # time: prefilling them in one batch runs other kernels (other float sums), and
        # a near-tie could then flip, so the continuation would not be the text the
        # uninterrupted request gives. One row a step costs a few ms per token.
        for i, tok in enumerate(resume):
            self.work.append(Work(g.req, n + i, tokens=np.array([tok], np.int32)))

    def tokenize(self, g: wire.Generate) -> list[int]:
        """Prompt token ids of ``g``: its chat messages through the model's template, or
        its plain prompt."""
        if g.messages is not None:
            messages = [m.as_dict() for m in g.messages]
            tools = None
            offered = g.tools.tools if g.tools is not None else []
            if offered or any(m.tool_calls or m.role == "tool" for m in g.messages):
                messages, tools = template_messages(
                    messages, [_tool_dict(t) for t in offered], self.tool_format
                )
            text = render_chat(
                self.template or CHATML_TEMPLATE,
                messages,
                add_generation_prompt=True,
                bos_token=self.bos_text,
                eos_token=self.eos_text,
                tools=tools or None,
            )
            # A template that writes {{ bos_token }} already starts with the BOS; adding
            # the vocabulary's own BOS too would double it (llama.cpp warns, and output
            # quality drops). Otherwise the vocabulary decides, as for a plain prompt.
            bos = bool(self.bos_text) and text.startswith(self.bos_text)
            return list(self.stage.tokenize(text, add_special=not bos, parse_special=True))
        if g.prompt_tokens is not None:
            bad = [t for t in g.prompt_tokens if not 0 <= t < self.stage.n_vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside [0, {self.stage.n_vocab})")
            return list(g.prompt_tokens)
        return list(self.stage.tokenize(g.prompt or "", add_special=True, parse_special=False))

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (read from its chat template)."""
        return tool_format(self.template)

    def with_tool_grammar(self, g: wire.Generate) -> wire.Generate:
        """``g``, its output constrained to one call when its ``tool_choice`` forces
        one (``required`` or a function's name); ValueError for a name not in its tools."""
        if g.tools is None or g.tools.choice == "auto":
            return g
        tools = g.tools.tools
        name = None if g.tools.choice == "required" else g.tools.choice
        if name is not None and all(t.name != name for t in tools):
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        # The call's arguments: strings bounded as in structured outputs, and no
        # argument the function does not declare.
        shown = [
            {**_tool_dict(t), "parameters": bounded_strings(closed_objects(t.parameters))}
            if t.parameters is not None else _tool_dict(t)
            for t in tools
        ]  # fmt: skip
        lark = forced_call_lark(shown, self.tool_format, name)
        grammar = lark_grammar(lark)
        check_grammar(grammar)
        return msgspec.structs.replace(
            g, sampling=msgspec.structs.replace(g.sampling, grammar=grammar)
        )

    # -- other stages ----------------------------------------------------------------
    def on_activation(self, a: wire.Activation, raw: list) -> None:
        if a.instance != self.cfg.instance:
            self.counters.dropped["wrong_instance"] += 1
            return
        if self.first:  # stage 0 takes tokens, never hidden rows
            self.counters.dropped["wrong_stage"] += 1
            return
        r = self.reqs.get(a.req)
        if a.generation != self.generation:
            self.counters.dropped["generation_mismatch"] += 1
            reply_to = r.reply_to if r else (a.start.reply_to if a.start else None)
            if reply_to is not None:
                self.fail(reply_to, a.req, "generation_mismatch", "plan changed during the request")
            if r is not None:
                self.release(r.req, "cancel")  # it cannot go on: free its KV here and on
            return
        if len(raw) != 1 or a.hidden != self.stage.hidden_size:
            self.counters.dropped["bad_tensor"] += 1
            return
        try:
            hidden = decode_rows(raw[0].buffer, a.dtype, a.rows, a.hidden)
        except TensorError:
            self.counters.dropped["bad_tensor"] += 1
            return
        if r is None:
            if a.start is None:
                self.counters.dropped["unknown_request"] += 1
                return
            if a.req in self.cancelled:
                # Its cancel came first (straight from the API node): never admit it.
                self.counters.dropped["cancelled"] += 1
                return
            s = a.start
            seq = self.seat(s, a.req)
            if seq is None:
                return
            r = Request(
                a.req, seq, list(s.route), s.reply_to, s.sampling, s.n_prompt,
                generation=a.generation, embed=s.embed, slot=s.slot, n_cached=s.prefix_n,
            )  # fmt: skip
            self.reqs[a.req] = r
            self.report_load()
            if self.last and not s.embed:
                try:
                    self.init_last(r, s.resume)
                except ValueError as e:  # stage 0 checks sampling; grammars compile here
                    self.fail(r.reply_to, r.req, "bad_sampling", str(e))
                    self.release(r.req, "cancel")
                    return
        if len(a.draft) > a.rows:
            self.counters.dropped["bad_tensor"] += 1
            return
        r.last_active = time.monotonic()
        r.spec = r.spec or bool(a.draft)
        w = Work(a.req, a.pos, hidden=hidden, start=a.start, compute=a.compute, draft=a.draft,
                 draft_by=a.draft_by, epoch=a.epoch)  # fmt: skip
        self.work.append(w)

    def forward_one(self, w: Work, item):
        """One item alone; on failure end its request with ``bad_input`` and None."""
        try:
            return self.stage.forward([item])[0]
        except Exception as e:
            log.warning("request %s failed at this stage: %s", w.req, e, extra={"req": w.req})
            r = self.reqs[w.req]
            self.fail(r.reply_to, r.req, "bad_input", f"stage {self.cfg.stage}: {e}")
            self.release(r.req, "cancel")
            return None

    def init_last(self, r: Request, resume: list[int]) -> None:
        """Sampling state of a request; a replay primes it with the tokens already sent,
        so held-back UTF-8 bytes and partial stop strings continue exactly, and the
        sampler starts at the position of the first new token, so a seeded stream
        draws what the uninterrupted run would have drawn."""
        s = r.sampling
        r.sampler = Sampler(
            sampling_params(s, self.stage.n_vocab), position=len(resume), history=resume
        )
        r.text = TextStream(self.stage.token_to_piece, list(s.stop))
        r.text.prime(resume)
        if s.grammar is not None:
            r.constraint = Constraint(self.grammar_vocab(), s.grammar, resume)
        r.n_generated = len(resume)
        r.replay_end = r.n_prompt + len(resume)

    # -- compute -------------------------------------------------------------------
    def step(self) -> None:
        """One engine call over every request that has work queued (one item each)."""
        batch: list[Work] = []
        seen: set[str] = set()
        rest: collections.deque[Work] = collections.deque()
        while self.work:
            w = self.work.popleft()
            r = self.reqs.get(w.req)
            if r is None:
                continue  # released while queued
            if w.epoch != r.epoch and (self.first or self.last):
                self.counters.stale_steps += 1  # sent before its request restarted
                continue
            if w.req in seen:
                rest.append(w)
            else:
                seen.add(w.req)
                batch.append(w)
        self.work = rest
        if self.last:
            # Embeddings run apart (a context of their own, every row out), together.
            embeds = [w for w in batch if self.reqs[w.req].embed]
            if embeds:
                batch = [w for w in batch if not self.reqs[w.req].embed]
                self.embed(embeds)
        if not batch:
            return
        # The n choices of one prompt bring the same prompt steps: each runs once, and
        # the others get its KV (Stage.share) and its output (see Prefill).
        keys = [self._step_key(w) for w in batch]
        run: list[Work] = []
        run_keys: list[bytes | None] = []
        followers: list[tuple[Work, bytes]] = []
        leading: set[bytes] = set()
        for w, k in zip(batch, keys, strict=True):
            if k is not None and (k in leading or self._live_prefill(k) is not None):
                followers.append((w, k))
            else:
                run.append(w)
                run_keys.append(k)
                if k is not None:
                    leading.add(k)
        items = [self._item(w) for w in run]
        outs: list = []
        spent = 0.0
        if items:
            rows = [it.n_rows for it in items]
            self.rows_run += sum(rows)
            self.age_kept()
            t0 = time.perf_counter()
            try:
                outs = self.stage.forward(items)
            except Exception:
                # One bad item fails the whole call: run them one by one so only the
                # requests at fault end (with a typed error), and the runner lives on.
                outs = [self.forward_one(w, it) for w, it in zip(run, items, strict=True)]
            else:
                # Outside the try: a failure here (the node gone, its pipe broken) must
                # not run the items a second time.
                self.clock.record(time.perf_counter() - t0, rows)
                if self.clock.news(t0):
                    self.report_load()
            spent = round(time.perf_counter() - t0, 6)
        for w, k, out in zip(run, run_keys, outs, strict=True):
            if out is None:
                continue
            self.reqs[w.req].lineage = k
            if k is not None and out.nbytes <= MAX_SHARED_OUTPUT:
                self._remember_prefill(k, Prefill([w.req], w.pos + _rows(w), np.array(out)))
            self.deliver(w, out, spent)
        for w, k in followers:
            p = self._live_prefill(k)
            r = self.reqs.get(w.req)
            if r is None:
                continue
            try:
                if p is None:
                    raise StageInputError("its prefill is gone")
                holder = next(h for h in p.holders if h in self.reqs)
                if w.pos:  # it holds the leader's first w.pos already: take all again
                    self.stage.free(r.seq)
                self.stage.share(self.reqs[holder].seq, r.seq, p.n)
                r.lineage = k
            except Exception:
                r.lineage = None
                item = StageInput(seq=r.seq, pos=w.pos, tokens=w.tokens, hidden=w.hidden)
                out = self.forward_one(w, item)
                if out is not None:
                    self.deliver(w, out, spent)
                continue
            self.counters.shared_prefills += 1
            p.holders.append(r.req)
            self.deliver(w, p.out, 0.0)

    def deliver(self, w: Work, out: np.ndarray, spent: float) -> None:
        """Send a step's output on: hidden rows to the next stage, or a sampled token."""
        r = self.reqs[w.req]
        r.last_active = time.monotonic()
        n = _rows(w)
        if not self.last:
            rows = encode_rows(out, self.cfg.send_dtype)
            act = wire.Activation(
                req=r.req, instance=self.cfg.instance, generation=self.generation,
                pos=w.pos, rows=rows.shape[0], hidden=rows.shape[1], start=w.start,
                compute=[*w.compute, spent], dtype=self.cfg.send_dtype, draft=w.draft,
                draft_by=w.draft_by, epoch=w.epoch,
            )  # fmt: skip
            self.send(r.route[self.cfg.stage + 1], act, memoryview(rows))
        elif w.draft:
            self.verify(r, out, w, [*w.compute, spent])
        elif w.pos + n >= r.replay_end:  # before it: a replay's tokens already sent
            tok = self.sample(r, out, w.pos + n, [*w.compute, spent])
            if tok is not None:
                self.feed_back(r, tok, w.pos + n)

    def verify(self, r: Request, logits: np.ndarray, w: Work, compute: list[float]) -> None:
        """A speculative step: draw from each row in turn, as one row a step would,
        while the draw equals the draft; the first other token (or the one after a
        whole accepted draft) is fed back. For a sampled request this is the standard
        rejection rule for a draft that is one token for sure: the draft is kept with
        the probability the model gives it, else the draw comes from the rest, so the
        output follows the same distribution as without a draft."""
        r.n_drafted += len(w.draft)
        by_model = w.draft_by == wire.DRAFT_BY_MODEL
        if by_model:
            r.n_model_drafted += len(w.draft)
        rows = _rows(w)
        for i in range(rows):
            # The step's compute goes with its first token only: the node adds up the
            # compute of the tokens a chunk carries.
            tok = self.sample(
                r, logits[i], w.pos + i + 1, compute if i == 0 else [0.0] * len(compute)
            )
            if tok is None:
                return  # finished (or failed)
            if i == len(w.draft) or tok != w.draft[i]:
                self.feed_back(r, tok, w.pos + i + 1)
                return
            r.n_accepted += 1
            r.n_model_accepted += by_model
        # A chained step held whole: its last token is the first of the step stage 0
        # sent after it, which goes on from here. Stage 0 is told, and sends another.
        r.n_chained += 1
        self.send(
            r.route[0],
            wire.Token(req=r.req, instance=self.cfg.instance, generation=self.generation,
                       token=w.draft[-1], pos=w.pos + rows, epoch=r.epoch),
        )  # fmt: skip

    def feed_back(self, r: Request, tok: int, pos: int) -> None:
        """Send the token just drawn to stage 0 (or queue it here), to run at ``pos``:
        a restart, which ends every step sent after the one it came from."""
        r.epoch += 1
        if self.first:
            self.feed(r, tok, pos)
        else:
            self.send(
                r.route[0],
                wire.Token(req=r.req, instance=self.cfg.instance, generation=self.generation,
                           token=tok, pos=pos, epoch=r.epoch),
            )  # fmt: skip

    def _item(self, w: Work) -> StageInput:
        """The engine's input for ``w``. A speculating request's step may start before
        what this stage holds (rows of a rejected draft): those are dropped first."""
        r = self.reqs[w.req]
        if r.spec and self.stage.n_past(r.seq) > w.pos:
            self.stage.truncate(r.seq, w.pos)
        # A row's logits for each drafted token, and for the one after them unless
        # the step is chained (then that is the next step's row).
        n_logits = min(len(w.draft) + 1, _rows(w)) if self.last and w.draft else 1
        return StageInput(r.seq, w.pos, tokens=w.tokens, hidden=w.hidden, n_logits=n_logits)

    def _step_key(self, w: Work) -> bytes | None:
        """The share key of a prompt step (None for any other: generated tokens differ
        from one choice to the next, and a request started from a cached prefix holds
        KV no other request's lineage vouches for)."""
        r = self.reqs[w.req]
        if r.lineage is None or r.n_cached or w.pos + _rows(w) > r.n_prompt:
            return None
        return _prefill_key(w, r.lineage)

    def _live_prefill(self, key: bytes) -> Prefill | None:
        p = self.prefills.get(key)
        if p is None:
            return None
        p.holders = [h for h in p.holders if h in self.reqs]
        return p if p.holders else None

    def _remember_prefill(self, key: bytes, p: Prefill) -> None:
        self.prefills[key] = p
        self.prefills.move_to_end(key)
        while len(self.prefills) > MAX_SHARED_PREFILLS:
            self.prefills.popitem(last=False)

    @functools.cached_property
    def pooling(self) -> Pooling:
        """How this model pools an input's hidden states (read on first use)."""
        return pooling_of(self.cfg.model_path)

    def embed(self, batch: list[Work]) -> None:
        """Pool the final hidden states of embeddings requests, send each one's vector
        and finish them (one at a time if their engine call fails, so only the request
        at fault ends)."""
        items = [
            StageInput(seq=self.reqs[w.req].seq, pos=0, tokens=w.tokens, hidden=w.hidden)
            for w in batch
        ]
        t0 = time.perf_counter()
        try:
            rows = self.stage.embed(items)
        except Exception as e:
            if len(batch) > 1:
                for w in batch:
                    self.embed([w])
                return
            r = self.reqs[batch[0].req]
            log.warning("embedding of %s failed: %s", r.req, e, extra={"req": r.req})
            self.fail(r.reply_to, r.req, "bad_input", f"stage {self.cfg.stage}: {e}")
            self.release(r.req, "cancel")
            return
        spent = round(time.perf_counter() - t0, 6)
        for w, x in zip(batch, rows, strict=True):
            r = self.reqs[w.req]
            vector = pool(x, self.pooling)
            self.chunk(
                r, r.reply_to, r.req, embedding=vector.astype("<f4").tobytes(),
                finish_reason="stop", usage=wire.Usage(r.n_prompt, 0),
                compute=[*w.compute, spent],
            )  # fmt: skip
            self.release(r.req, "done")

    def token_logprob(self, d: Draw) -> wire.TokenLogprob:
        """``d`` for the wire, each token with its bytes (special tokens as their text)."""

        def piece(t: int) -> bytes:
            return self.stage.token_to_piece(t, special=True)

        top = [wire.TopLogprob(t, lp, piece(t)) for t, lp in d.top]
        return wire.TokenLogprob(token=d.token, logprob=d.logprob, piece=piece(d.token), top=top)

    def grammar_vocab(self) -> GrammarVocab:
        """The vocabulary as the grammar engine reads it (built on first use)."""
        if self._grammar_vocab is None:
            self._grammar_vocab = GrammarVocab(self.stage)
        return self._grammar_vocab

    def sample(
        self, r: Request, logits: np.ndarray, next_pos: int, compute: list[float]
    ) -> int | None:
        """Pick the next token of ``r`` and send its text; the token, or None when
        the request finished here (or failed)."""
        assert r.sampler is not None and r.text is not None  # last stage: init_last ran
        c = r.constraint
        try:
            if c is not None:
                logits = c.mask(logits)
            drawn = r.sampler.draw(logits, r.n_generated, r.sampling.logprobs)
            if c is not None and drawn.token not in self.eos:
                c.accept(drawn.token)
        except ValueError as e:  # a bias, penalty or grammar that leaves no token
            self.fail(r.reply_to, r.req, "bad_sampling", str(e))
            self.release(r.req, "cancel")
            return None
        tok = drawn.token
        r.n_generated += 1
        finish = None
        text = ""
        logprobs: list[wire.TokenLogprob] = []
        if tok in self.eos and (c is not None or not r.sampling.ignore_eos):
            finish = "stop"  # the end token is not part of the answer, nor its logprob
        else:
            if r.sampling.logprobs is not None:
                logprobs.append(self.token_logprob(drawn))
            text, stopped = r.text.push(tok)
            if stopped or (c is not None and c.done):
                finish = "stop"
            elif (
                r.sampling.max_tokens is not None and r.n_generated >= r.sampling.max_tokens
            ) or next_pos + 1 >= self.n_ctx:
                finish = "length"
        if finish is not None:
            # Whatever ended the stream, text held back for a possible stop string or an
            # unfinished character belongs to the output (an EOS right after "Hello." with
            # stop ".\n" must not eat the "."); after a stop string finish() adds nothing.
            text += r.text.finish()
            if r.text.matched is not None:
                finish = "stop"  # the held-back tail completed a stop string
            usage = wire.Usage(
                r.n_prompt, r.n_generated, r.n_cached, r.n_drafted, r.n_accepted,
                r.n_model_drafted, r.n_model_accepted, r.n_chained,
            )  # fmt: skip
            # The release first: it reaches stage 0 before the client's next turn can
            # (that goes through the API node), so the turn finds this KV kept there.
            # Every position before this token holds the answer's KV; rows after it
            # (the rest of a draft, a chained step's) are not kept.
            self.release(r.req, "done", next_pos)
            self.chunk(
                r, r.reply_to, r.req, text=text, tokens=[tok], finish_reason=finish, usage=usage,
                logprobs=logprobs, stop_sequence=r.text.matched,
            )  # fmt: skip
            return None
        self.chunk(
            r, r.reply_to, r.req, text=text, tokens=[tok], compute=compute, logprobs=logprobs
        )
        return tok

    def release(self, req: str, reason: str, n_kv: int = -1) -> None:
        """Free ``req`` here and pass the release down the chain.

        A request still queued for a slot (stage 0) is dropped from the queue: it was
        never admitted, so no other stage holds it. A cancel for a request this stage
        does not know is fine (it finished, expired, or its cancel also came another
        way); the id is remembered so that its activation, if still on its way, is
        not admitted after its cancel.
        """
        if reason != "done":  # "done": the answer's last chunk is on its way
            self.outbox.forget(req)
        r = self.reqs.pop(req, None)
        if r is None:
            for g in self.waiting:
                if g.req == req:
                    self.waiting.remove(g)
                    log.info("request %s cancelled while queued", req, extra={"req": req})
                    return
            if reason == "cancel":
                self.cancelled[req] = None
                if len(self.cancelled) > MAX_CANCELLED:
                    self.cancelled.popitem(last=False)
            return
        if reason == "done" and not r.embed:
            self.keep(r, n_kv)
        else:
            if reason == "prefix_miss" and r.source in self.kept:
                self.drop_kept(r.source)
            self.free(r)
        if reason == "prefix_miss":
            reason = "cancel"  # the stages after this one free it like any cancel
        nxt = self.cfg.stage + 1
        if self.last and not self.first and reason == "done":
            # The last stage finished the request: start the release walk at stage 0.
            self.send(
                r.route[0],
                wire.Release(req=req, instance=self.cfg.instance, reason=reason, n_kv=n_kv),
            )
        elif nxt < self.cfg.n_stages and (reason == "cancel" or nxt < self.cfg.n_stages - 1):
            self.send(
                r.route[nxt],
                wire.Release(req=req, instance=self.cfg.instance, reason=reason, n_kv=n_kv),
            )
        self.admit_waiting()

    def free(self, r: Request) -> None:
        """Give ``r``'s KV slot back here (nothing is sent)."""
        self.reqs.pop(r.req, None)
        self.drafts.forget(r.req)
        self.stage.free(r.seq)
        self.free_seqs.append(r.seq)
        self.report_load()

    # -- prefix cache ------------------------------------------------------------------
    def has_room(self) -> bool:
        """Whether a new request can have a sequence (a free one, a kept one, or one
        drafting for another model)."""
        return bool(self.free_seqs or self.kept or (self.draft_server and self.draft_server.held))

    def on_token(self, r: Request, t: wire.Token) -> None:
        """Stage 0: the last stage's word on ``r``'s oldest step in flight."""
        step = r.flight.confirm(t.pos) if t.epoch == r.epoch else None
        if step is None:
            r.epoch = t.epoch
            self.feed(r, t.token, t.pos)
            return
        self.timed(r, step, step.k, bonus=False)
        if r.flight.successor is not None and len(r.flight) < self.chain_depth:
            token, pos = r.flight.successor
            r.flight.successor = None
            self.launch(r, token, pos)

    def timed(self, r: Request, step: Step | None, held: int, bonus: bool = True) -> None:
        """Tell ``r``'s draft budget how ``step`` fared (None: no step was in
        flight), timed from the token before: ``held`` of its draft held, and
        ``bonus``, a token after them came back (a restart)."""
        b = r.budget
        if b is None:
            return
        now = time.perf_counter()
        took = now - r.fed_at if r.fed_at else 0.0
        r.fed_at = now
        if step is not None and step.k:
            b.record(step.k, max(0, min(step.k, held)), took, bonus)
        elif took:
            b.plain(took)

    @property
    def chain_depth(self) -> int:
        """Steps of one request in flight at once: one a stage keeps every stage of a
        split busy; one stage has nothing to overlap."""
        return self.cfg.n_stages

    def feed(self, r: Request, token: int, pos: int) -> None:
        """Queue ``token`` at ``pos`` (stage 0): every step sent before is over (any
        left queued here is dropped unrun, as the last stage drops any on its way)."""
        if r.tokens is not None:
            del r.tokens[pos:]  # a rejected draft's tokens
            self.drafts.truncated(r.req, pos)
            if len(r.tokens) == pos:
                r.tokens.append(token)
        step = r.flight.restart()
        self.timed(r, step, pos - step.pos - 1 if step is not None else 0)
        self.launch(r, token, pos)

    def launch(self, r: Request, token: int, pos: int) -> None:
        """Send the step feeding ``token`` at ``pos`` (its KV joins what ``r``
        holds), with a draft after it when the request speculates: from its own text,
        else from the draft model (then the step waits for the proposal). Over a split
        a step with a whole lookup draft is chained, and the step after it follows
        while there is room in flight."""
        b = r.budget
        draft: list[int] = []
        k = min(b.k, self.n_ctx - pos - 2) if b is not None else 0
        # A chained step's draft names one token more: the next step's first.
        extra = 1 if self.chain_depth > 1 and k > 0 else 0
        if b is not None and b.on and r.tokens is not None and len(r.tokens) == pos + 1:
            # With a draft model to ask, only the surest lookups (the longest n-gram
            # found again: text being quoted) go before it.
            model = self.drafts.usable(r.req)
            draft = prompt_lookup(r.tokens, k + extra, MAX_NGRAM if model else MIN_NGRAM)
            if not draft and k > 0 and model and not r.flight:
                wait = self.drafts.wait_s(b.plain_s)
                self.drafts.ask(r.req, r.tokens, k, r.route[0], wait)
                return  # on_proposal (or run_undrafted) queues the step
        chained = extra == 1 and len(draft) == k + 1
        self.queue_step(r, token, pos, draft, wire.DRAFT_BY_LOOKUP, chained=chained)
        if not chained:
            return
        if len(r.flight) < self.chain_depth:
            self.launch(r, draft[-1], pos + k + 1)
        else:
            r.flight.successor = (draft[-1], pos + k + 1)

    def queue_step(
        self,
        r: Request,
        token: int,
        pos: int,
        draft: list[int],
        by: str = "",
        chained: bool = False,
        asked: int = 0,
    ) -> None:
        """Queue the step feeding ``token`` at ``pos``, and ``draft`` (written by
        ``by``) after it; ``chained``: the draft's last token is the next step's
        first, not a row of this one. ``asked``: tokens asked of a draft model that
        gave none (the budget counts them as a draft that failed)."""
        if draft:
            assert r.tokens is not None
            r.tokens += draft
            r.spec = True
        rows = draft[:-1] if chained else draft
        tokens = np.array([token, *rows], np.int32)
        r.flight.sent(Step(pos, len(draft) or asked, chained))
        self.work.append(Work(r.req, pos, tokens=tokens, draft=draft,
                              draft_by=by if draft else "", epoch=r.epoch))  # fmt: skip

    def on_proposal(self, p: wire.Proposal) -> None:
        """A draft model's answer: the step that waited for it runs now."""
        if p.instance != self.cfg.instance:
            self.counters.dropped["wrong_instance"] += 1
            return
        got = self.drafts.answer(p)
        r = self.reqs.get(p.req)
        if got is None or r is None:
            return
        pend, draft = got
        # A draft model padded to more embedding rows may name ids past this model's
        # (never trained, never likely): the draft ends before the first such one.
        n_vocab = self.stage.n_vocab
        cut = next((i for i, t in enumerate(draft) if not 0 <= t < n_vocab), len(draft))
        draft = draft[: min(cut, max(0, self.n_ctx - pend.pos - 2))]
        self.drafts.truncated(r.req, pend.pos + 1 + len(draft))
        # Asked and waited for, none given: timed as a draft that failed.
        self.queue_step(r, pend.token, pend.pos, draft, wire.DRAFT_BY_MODEL, asked=pend.k)

    def run_undrafted(self, now: float) -> None:
        """Queue without a draft the steps whose proposal did not come in time."""
        for req, pend in self.drafts.overdue(now):
            r = self.reqs.get(req)
            if r is not None:
                # Timed as a draft none of which held: the budget stops asking a draft
                # model that does not answer in time, as one whose drafts fail.
                self.queue_step(r, pend.token, pend.pos, [], asked=pend.k)

    def keep(self, r: Request, n_kv: int = -1) -> None:
        """Finish ``r`` here, its KV kept for a later request with the same start: its
        first ``n_kv`` positions (-1: all it holds)."""
        self.reqs.pop(r.req, None)
        self.drafts.forget(r.req)
        n = self.stage.n_past(r.seq)
        if 0 <= n_kv < n:
            # Rows past the answer's last token: every stage keeps the same positions
            # (a stage that ran a chained step the last stage dropped holds more).
            self.stage.truncate(r.seq, n_kv)
            n = n_kv
        tokens = r.tokens
        if tokens is not None:
            # What the sequence holds: the last token sampled was never fed.
            tokens = tokens[:n]
        if r.slot in self.kept:  # cannot happen unless stage 0 reused a live slot
            self.drop_kept(r.slot)
        self.kept[r.slot] = Kept(r.seq, tokens, self.rows_run)
        self.report_load()

    def drop_kept(self, slot: int) -> None:
        """Forget the KV kept under ``slot``; its sequence is free again."""
        k = self.kept.pop(slot)
        self.stage.free(k.seq)
        self.free_seqs.append(k.seq)

    def age_kept(self) -> None:
        """Drop the prefixes kept unused for more rows than they are worth
        (``Stage.kept_rows``): least recently used first."""
        while self.kept and self.kept_rows is not None:
            slot, k = next(iter(self.kept.items()))
            if self.rows_run - k.rows_at <= self.kept_rows:
                return
            self.drop_kept(slot)
            self.counters.prefixes_aged += 1

    def drop_all_kept(self) -> None:
        """Forget every kept prefix (a cold request, a new plan)."""
        for slot in list(self.kept):
            self.drop_kept(slot)

    def _take_seq(self) -> int | None:
        """A free sequence for a draft, a kept prefix given up for it if need be;
        None when every sequence serves a request."""
        if not self.free_seqs:
            self._free_one(spare=-1, drafts=False)
        return self.free_seqs.pop() if self.free_seqs else None

    def _free_one(self, spare: int, drafts: bool = True) -> bool:
        """Free the least recently used kept sequence but ``spare``'s, else (with
        ``drafts``) the one drafting for the least recent other model's request: this
        model's own requests come first. False if none."""
        victim = next((slot for slot in self.kept if slot != spare), None)
        if victim is not None:
            self.drop_kept(victim)
            return True
        ds = self.draft_server
        return drafts and ds is not None and ds.release_oldest()

    def seat_first(self, prompt: list[int] | None) -> tuple[int, int, int]:
        """Stage 0: a sequence for a new request whose prompt is ``prompt`` (None:
        no prefix reuse), as ``(seq, source slot or -1, positions reused)``.

        The kept sequence sharing the longest start with the prompt is its source:
        copied into a free sequence when there is one (it stays kept for the next
        request), else taken over. At least the prompt's last token is computed again,
        for its logits."""
        source, n = -1, 0
        if prompt is not None:
            for slot, k in self.kept.items():  # oldest first: ties go to the newest
                m = min(common_prefix(k.tokens or [], prompt), len(prompt) - 1)
                if m >= MIN_PREFIX and m >= n:
                    source, n = slot, m
        if not self.free_seqs:
            self._free_one(spare=source)
        # With no free sequence left, the source itself becomes the request's.
        seq = self.free_seqs.pop() if self.free_seqs else self.kept.pop(source).seq
        if source >= 0:
            self._reuse(source, seq, n)
        return seq, source, n

    def seat(self, s: wire.Start, req: str) -> int | None:
        """A later stage: the sequence for a new request, prefix copied as stage 0
        said; None (the request ended with an error) when this stage cannot."""
        if s.cold:
            self.drop_all_kept()
        if s.slot in self.kept and s.slot != s.prefix_slot:
            self.drop_kept(s.slot)  # stage 0 gave that slot to this request
        if s.prefix_slot >= 0 and s.prefix_slot not in self.kept:
            self.miss(s, req, "no longer holds the cached prefix")
            return None
        if not self.free_seqs and s.prefix_slot != s.slot:
            self._free_one(spare=s.prefix_slot)
        if s.prefix_slot >= 0 and (s.prefix_slot == s.slot or not self.free_seqs):
            # Taken over: stage 0 said so, or this stage has fewer sequences than it
            # (stage 0 still counts on the prefix; a miss later tells it otherwise).
            seq = self.kept.pop(s.prefix_slot).seq
        elif self.free_seqs:
            seq = self.free_seqs.pop()
        else:
            self.fail(s.reply_to, req, "overloaded", "stage has no free sequence")
            return None
        if s.prefix_slot >= 0:
            try:
                self._reuse(s.prefix_slot, seq, s.prefix_n)
            except StageInputError as e:
                self.stage.free(seq)
                self.free_seqs.append(seq)
                self.miss(s, req, str(e))
                return None
        return seq

    def miss(self, s: wire.Start, req: str, why: str) -> None:
        """End a request whose cached prefix this stage lacks; stage 0 forgets that
        prefix (``prefix_miss`` release), so the replay and later requests compute."""
        self.fail(s.reply_to, req, "prefix_miss", f"stage {self.cfg.stage} {why}")
        self.send(s.route[0], wire.Release(req=req, instance=self.cfg.instance,
                                           reason="prefix_miss"))  # fmt: skip

    def _reuse(self, source: int, seq: int, n: int) -> None:
        """Make ``seq`` hold the first ``n`` positions kept under slot ``source``
        (``seq`` is that very sequence when the request took it over)."""
        k = self.kept.get(source)
        if k is None:
            self.stage.truncate(seq, n)
        else:
            self.stage.share(k.seq, seq, n)
            self.kept.move_to_end(source)
            k.rows_at = self.rows_run
        self.counters.prefix_hits += 1
        self.counters.prefix_tokens += n

    def admit_waiting(self) -> None:
        """Admit queued requests while slots are free."""
        while self.waiting and self.has_room():
            g = self.waiting.popleft()
            if g.generation != self.generation:
                self.refuse_generation(g)  # the plan moved on while it waited
            else:
                self.admit(g)


class StdinLines:
    """Lines from the node on fd 0, read without Python's buffering (so that the poller
    and the reader never disagree about what is waiting)."""

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        self._buf = b""

    def read(self) -> list[bytes] | None:
        """The complete lines available now; None at EOF (the node is gone)."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        self._buf += data
        return self.buffered()

    def buffered(self) -> list[bytes]:
        """The complete lines already read from the fd. The read that brought the config
        may have brought the node's next commands too (a new generation sent while this
        process started): the poller will not report them again."""
        *lines, self._buf = self._buf.split(b"\n")
        return [line for line in lines if line.strip()]

    def first(self) -> bytes:
        """Block for the first line (the config); EOF before it raises EOFError."""
        while b"\n" not in self._buf:
            data = os.read(self.fd, 1 << 16)
            if not data:
                raise EOFError("the node closed stdin before sending the config")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line


def main(argv: list[str] | None = None) -> int:
    """Entry point of a runner process (``python -m meshd.engines.runner INSTANCE STAGE``,
    the config on stdin)."""
    # A Ctrl-C in the node's terminal reaches its whole process group; the node drains
    # (its stages move, its streams finish) and then stops its runners itself. A runner
    # that died on the same SIGINT would cut every stream mid-drain and count as a
    # crash. SIGTERM stays fatal: it is how the supervisor stops a runner.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Text at info until the config (the first line) says how its node logs.
    name = f"runner {os.getpid()}"
    configure_logs("info", "text", name=name)
    stdin = StdinLines()
    try:
        cfg = decode_config(stdin.first())
    except (EOFError, msgspec.DecodeError, msgspec.ValidationError) as e:
        emit(Failed(reason=f"bad runner config: {e}"))
        return 1
    configure_logs(cfg.log_level, cfg.log_format, name=name)
    ctx = zmq.Context()
    keys = cfg.keys.cluster_keys() if cfg.keys is not None else None
    members: set[bytes] | None = None
    if cfg.keys is not None:
        members = {k.encode() for k in cfg.keys.members}
        admitted = members
        start_zap(ctx, admitted.__contains__, lambda: log.warning("refused a non-member peer"))
    router = open_socket(ctx, zmq.ROUTER, DATA, keys, server=True)
    port = bind(router, cfg.bind_host)
    emit(Listening(port=port))
    try:
        stage = load_stage(cfg)
        template = None
        if cfg.stage == 0:
            template = chat_template_at(cfg.model_path)
    except Exception as e:
        log.exception("could not load the stage")
        emit(Failed(reason=f"{type(e).__name__}: {e}"))
        return 1
    try:
        layer_ms = calibrate(stage, cfg.end - cfg.start)
    except Exception:
        # A figure for placement, not a condition of serving.
        log.warning("could not time a decode step", exc_info=True)
        layer_ms = 0.0
    emit(Ready(layer_ms=round(layer_ms, 4)))
    runner = Runner(cfg, stage, ctx, router, template, keys)
    runner.clock.ms = runner.clock.reported = layer_ms
    try:
        runner.serve(stdin, members)
    finally:
        runner.dealers.close()
        router.close(linger=0)
    return 0


def check_model(cfg: RunnerConfig) -> None:
    """Refuse to run weights other than the ones placed.

    The plan names a model by path or repo id, and this node resolved it to a local
    file; another machine's file at the same path can be another model (or another
    quantization). Stages of different weights would run together and produce garbage
    without any error, and slices are cached by the placed sha256. The local hash is
    cached by (path, size, mtime), so a model is hashed once per change.
    """
    if not cfg.sha256 or cfg.sliced:
        return
    path = Path(cfg.model_path)
    if path.is_dir():
        local = folder_sha256(path, Path(cfg.cache_dir))
    else:
        local = file_sha256(path, Path(cfg.cache_dir))
    if local != cfg.sha256:
        raise ValueError(
            f"{path} on this node is not the model that was placed "
            f"(sha256 {local[:12]} here, {cfg.sha256[:12]} in the plan)"
        )


def load_stage(cfg: RunnerConfig):
    """Load this stage's layers in its engine (a llama.cpp slice, or MLX on the GGUF)."""
    check_model(cfg)
    first, last = cfg.stage == 0, cfg.stage == cfg.n_stages - 1
    # A fetched slice holds the stage's blocks only, numbered from 0.
    start, end = (0, cfg.end - cfg.start) if cfg.sliced else (cfg.start, cfg.end)
    if cfg.engine == "mlx":
        from .mlx_stage import MlxStage

        return MlxStage(
            Path(cfg.model_path), start=start, end=end, first=first, last=last,
            n_ctx=cfg.n_ctx, n_seq_max=cfg.n_seq_max, exact=cfg.exact,
        )  # fmt: skip
    if cfg.engine != "llama_cpp":
        raise ValueError(f"engine {cfg.engine!r} is not available in this runner")
    from .llama_stage import LlamaStage

    configure_threads()
    path = Path(cfg.model_path)
    if not cfg.sliced:
        path = slice_gguf(path, cfg.start, cfg.end, Path(cfg.cache_dir), cfg.sha256)
    return LlamaStage(
        path, first=first, last=last, n_ctx=cfg.n_ctx, n_seq_max=cfg.n_seq_max,
        exact=cfg.exact, n_threads=cfg.n_threads, kv_cache=cfg.kv_cache,
        n_gpu_layers=cfg.n_gpu_layers,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

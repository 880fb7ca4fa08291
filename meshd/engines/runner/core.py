"""What a stage does with each data-plane message, each step and each tick.

Each part owns its state and returns what must happen next (:mod:`.admission` an
admitted request or a refusal, :mod:`.seats` a sequence or a refusal, :mod:`.step`
each request's output, :mod:`.output` how a request ended); this class asks them
and acts on their answers, and alone ends a request's hold (:mod:`.requests`).
Sockets, stdin and the poller are the loop's (:mod:`.loop`)."""

from __future__ import annotations

import collections
import logging
import time

import zmq

from meshd.engines.calibrate import LayerClock
from meshd.engines.draft_model import DraftClient, DraftServer
from meshd.engines.guard import fault_injection, hop_dtype, output_fault
from meshd.engines.protocol import STAGE_FAULT, Failed, GenerationAdopted, Load, RunnerConfig
from meshd.engines.stage import Stage
from meshd.transport import wire
from meshd.transport.tensors import TensorError, decode_rows, encode_rows

from .admission import Admitted, admit, capped, join, prompts_for
from .links import Links, emit
from .output import Ended, Output
from .requests import Requests
from .seats import Seats
from .speculation import Speculation
from .state import Counters, Refused, Request, Work
from .step import Done, Stepper

log = logging.getLogger("meshd.runner")

#: Requests stage 0 queues per KV slot before it refuses more (``overloaded``): room
#: for several API nodes' admitted requests (a waiting Generate costs only its
#: message), while a flood of Generates does not grow it.
MAX_WAITING_PER_SEQ = 32


class RunnerCore:
    """One engine stage's requests, from their first message to their release."""

    def __init__(
        self, cfg: RunnerConfig, stage: Stage, links: Links, template: str | None = None
    ) -> None:
        self.cfg = cfg
        self.stage = stage
        self.links = links
        self.counters: Counters = links.counters
        self.first = cfg.stage == 0
        self.last = cfg.stage == cfg.n_stages - 1
        self.generation = cfg.generation
        #: Milliseconds per layer of the decode steps this stage runs (placement's
        #: speed figure, sent with every Load report).
        self.clock = LayerClock(cfg.end - cfg.start)
        # Later stages count a request's rows a little after stage 0 does, and must
        # not drop a prefix stage 0 still counts on (a prefix_miss costs a replay).
        # Where kept KV slows no one (None, 0), only room evicts it.
        rows = cfg.kept_prefix_rows if cfg.kept_prefix_rows is not None else stage.kept_rows
        kept_rows = rows * (2 if self.first else 3) // 2 if rows else None
        self.seats = Seats(stage, cfg.n_seq_max, kept_rows, self.counters)
        self.stepper = Stepper(stage, self.seats, self.clock, self.counters, cfg)
        self.work: collections.deque[Work] = collections.deque()
        #: Tokens one request may span: the runner's KV room per request, but never
        #: past what the model was trained for (positions beyond it are garbage).
        self.n_ctx = min(cfg.n_ctx, stage.n_ctx_train or cfg.n_ctx)
        self.prompts = prompts_for(cfg, stage, template) if self.first else None
        self.output = Output(stage, self.n_ctx, cfg.model_path, links) if self.last else None
        #: Stage 0: drafts from a draft model's runner, when the node names one.
        self.drafts = DraftClient(cfg.instance, links.send)
        self.spec = Speculation(cfg, self.n_ctx, stage.n_vocab, self.drafts, self.work.append)
        self.requests = Requests(
            self.seats, links, self.drafts, MAX_WAITING_PER_SEQ * cfg.n_seq_max
        )
        self.reqs = self.requests.held
        #: The fault drill, when ``$MESHD_FAULT_INJECT`` asks for one (meshd.engines.guard).
        self.inject = fault_injection()
        #: Why this stage's output was corrupt, once it was (reported once).
        self.faulted = ""
        #: A whole-model stage: drafts for other models' requests (it may be a draft
        #: model; see meshd.engines.draft_model).
        self.draft_server = (
            DraftServer(stage, self.n_ctx, self.seats.take, self.seats.free.append, links.send)
            if self.first and self.last and stage.generative
            else None
        )
        self.seats.drafting = self.draft_server

    def report_load(self) -> None:
        """Tell the supervisor how many requests hold KV here (it shows in the heartbeat)."""
        ds, c = self.draft_server, self.counters
        emit(Load(active=len(self.reqs), layer_ms=round(self.clock.ms, 4), busy_s=c.busy_s,
                  proposed=ds.proposed if ds is not None else 0, widest=c.widest,
                  waiting=len(self.requests.waiting), **c.prefills()))  # fmt: skip

    # -- messages ----------------------------------------------------------------------
    def handle(self, msg: wire.StageMessage, raw: list[zmq.Frame]) -> None:
        """Act on one data-plane message (``raw``: the frames after its header)."""
        if isinstance(msg, wire.Generate):
            self.on_generate(msg)
        elif isinstance(msg, wire.Activation):
            self.on_activation(msg, raw)
        elif isinstance(msg, wire.Token):
            self.on_token(msg)
        elif isinstance(msg, wire.Release):
            self.on_release(msg)
        elif isinstance(msg, wire.Propose):
            if self.draft_server is None or msg.instance != self.cfg.instance:
                self.counters.drop("wrong_stage")
            else:
                self.draft_server.ask(msg)
        elif msg.instance != self.cfg.instance:  # a Proposal
            self.counters.drop("wrong_instance")
        else:
            self.spec.on_proposal(self.reqs.get(msg.req), msg)

    def on_generate(self, g: wire.Generate) -> None:
        """Stage 0: a new request, admitted now, queued for a sequence, or refused."""
        if g.instance != self.cfg.instance or not self.first:
            self.links.fail(g.reply_to, g.req, "wrong_stage",
                            "this runner is not stage 0 of the instance")  # fmt: skip
        elif g.generation != self.generation:
            self.refuse_generation(g)
        elif g.req in self.requests.cancelled:
            self.counters.drop("cancelled")
        elif self.seats.has_room() and not self.requests.waiting:
            self.requests.waiting.turn(g.job.client)
            self.admit(capped(g, self.cfg.max_tokens))
        elif self.requests.waiting.full():
            self.links.fail(g.reply_to, g.req, "overloaded", "stage 0 has too many queued")
        else:
            self.requests.waiting.add(capped(g, self.cfg.max_tokens), time.monotonic())
            self.requests.tell_places()
            self.report_load()

    def on_activation(self, a: wire.Activation, raw: list[zmq.Frame]) -> None:
        """A later stage: hidden rows of a request's step (its first brings ``start``)."""
        if a.instance != self.cfg.instance:
            self.counters.drop("wrong_instance")
            return
        if self.first:  # stage 0 takes tokens, never hidden rows
            self.counters.drop("wrong_stage")
            return
        r = self.reqs.get(a.req)
        if a.generation != self.generation:
            self.counters.drop("generation_mismatch")
            reply_to = r.reply_to if r else (a.start.reply_to if a.start else None)
            if reply_to is not None:
                self.links.fail(reply_to, a.req, "generation_mismatch",
                                "plan changed during the request")  # fmt: skip
            if r is not None:
                self.release(r.req, "cancel")  # it cannot go on: free its KV here and on
            return
        if len(raw) != 1 or a.hidden != self.stage.hidden_size or len(a.draft) > a.rows:
            self.counters.drop("bad_tensor")
            return
        try:
            hidden = decode_rows(raw[0].buffer, a.dtype, a.rows, a.hidden)
        except TensorError:
            self.counters.drop("bad_tensor")
            return
        if r is None:
            r = self.join(a)
            if r is None:
                return
        r.last_active = time.monotonic()
        r.spec = r.spec or bool(a.draft)
        self.work.append(Work(a.req, a.pos, hidden=hidden, start=a.start, compute=a.compute,
                              draft=a.draft, draft_by=a.draft_by, epoch=a.epoch))  # fmt: skip

    def join(self, a: wire.Activation) -> Request | None:
        """A later stage: seat the request ``a`` starts (None: it is not taken)."""
        s = a.start
        if s is None:
            self.counters.drop("unknown_request")
            return None
        if a.req in self.requests.cancelled:
            # Its cancel came first (straight from the API node): never admit it.
            self.counters.drop("cancelled")
            return None
        try:
            r = join(a, s, self.seats)
        except Refused as e:
            if e.code == "prefix_miss":
                # Stage 0 forgets that prefix, so the replay and later requests compute.
                self.links.fail(s.reply_to, a.req, e.code, f"stage {self.cfg.stage} {e.message}")
                self.links.release(s.route[0], a.req, "prefix_miss")
            else:
                self.links.fail(s.reply_to, a.req, e.code, e.message)
            return None
        self.reqs[a.req] = r
        self.report_load()
        return r if self.start_output(r, s.resume) else None

    def on_token(self, t: wire.Token) -> None:
        """Stage 0: the last stage's word on a request's step."""
        r = self.reqs.get(t.req)
        if t.generation != self.generation:
            self.counters.drop("generation_mismatch")
            if r is not None:
                self.links.fail(r.reply_to, r.req, "generation_mismatch",
                                "plan changed during the request")  # fmt: skip
                self.release(t.req, "cancel")
        elif r is None:
            self.counters.drop("unknown_request")
        else:
            r.last_active = time.monotonic()
            self.spec.on_token(r, t)

    def on_release(self, m: wire.Release) -> None:
        """A request is over (or, from another instance, a draft it asked of this one)."""
        if m.instance == self.cfg.instance:
            self.release(m.req, m.reason, m.n_kv)
        elif self.draft_server is not None and self.draft_server.release(m.req):
            # A target's stage 0 done with a request this runner drafted for.
            self.admit_waiting()

    # -- admission ---------------------------------------------------------------------
    def refuse_generation(self, g: wire.Generate) -> None:
        """End ``g`` with a typed error: it names another plan generation."""
        self.links.fail(
            g.reply_to, g.req, "generation_mismatch",
            f"plan generation {g.generation} != runner generation {self.generation}",
        )  # fmt: skip

    def admit(self, g: wire.Generate, waited_s: float = 0.0) -> None:
        """Stage 0: :func:`.admission.admit` ``g`` (it waited ``waited_s``), queue its prompt."""
        assert self.prompts is not None  # stage 0
        t0 = time.perf_counter()
        try:
            got = admit(g, self.prompts, self.seats, self.cfg, self.n_ctx)
        except Refused as e:
            self.links.fail(g.reply_to, g.req, e.code, e.message, n_prompt=e.n_prompt)
            return
        if not isinstance(got, Admitted):
            # Counted, not run: nothing is allocated, so nothing needs releasing.
            self.links.chunk(g.reply_to, wire.DataChunk(
                req=g.req, n_prompt=got, finish_reason="stop", usage=wire.Usage(got, 0)
            ))  # fmt: skip
            return
        r = got.request
        if got.speculate:
            self.spec.start(r)
        self.reqs[g.req] = r
        self.report_load()
        fmt = self.prompts.tool_format if g.job.tools else None
        self.links.chunk(g.reply_to, wire.DataChunk(
            req=g.req, n_prompt=r.n_prompt, tool_format=fmt, n_cached=r.n_cached,
            waited_s=round(waited_s, 3), admit_s=round(time.perf_counter() - t0, 6),
        ))  # fmt: skip
        if self.start_output(r, got.start.resume):
            self.work.extend(self.stepper.chunker.cut(r, got.work))

    def start_output(self, r: Request, resume: list[int]) -> bool:
        """The last stage: ``r``'s sampling state; False when ``r`` ended instead."""
        if self.output is None or r.embed:
            return True
        try:
            self.output.init(r, resume)
        except ValueError as e:  # stage 0 checks sampling; grammars compile here
            self.links.fail(r.reply_to, r.req, "bad_sampling", str(e))
            self.release(r.req, "cancel")
            return False
        return True

    def admit_waiting(self) -> None:
        """Admit queued requests, each client in turn, while slots are free."""
        waiting = self.requests.waiting
        took = False
        while waiting and self.seats.has_room():
            now = time.monotonic()
            w = waiting.take(self.requests.seated(), now)
            assert w is not None
            took = True
            if w.g.generation != self.generation:
                self.refuse_generation(w.g)  # the plan moved on while it waited
            else:
                self.admit(w.g, waited_s=now - w.since)
        if took:
            self.requests.tell_places()
            self.report_load()

    # -- compute -----------------------------------------------------------------------
    def step(self) -> None:
        """One engine call over the work queued (see :meth:`.step.Stepper.take`)."""
        batch = self.stepper.take(self.work, self.reqs)
        if self.output is not None:
            # Embeddings run apart (a context of their own, every row out), together.
            embeds = [(self.reqs[w.req], w) for w in batch if self.reqs[w.req].embed]
            if embeds:
                batch = [w for w in batch if not self.reqs[w.req].embed]
                for (r, _), ended in zip(embeds, self.output.embed(embeds), strict=True):
                    self.end(r, ended)
        if not batch:
            return
        ran = self.stepper.run(batch, self.reqs)
        if ran.news:
            self.report_load()
        for d in ran.done:
            self.finish(d)
        for d in self.stepper.follow(ran, self.reqs):
            self.finish(d)

    def finish(self, d: Done) -> None:
        """Send a step's output on: hidden rows to the next stage, or what the last
        stage made of them; a step the engine refused ends its request."""
        w = d.work
        r = self.reqs[w.req]
        if d.out is None:
            self.links.fail(r.reply_to, r.req, "bad_input", f"stage {self.cfg.stage}: {d.error}")
            self.release(r.req, "cancel")
            return
        out = d.out if self.inject is None else self.inject(d.out)
        if (why := output_fault(out)) is not None:
            self.fault(r, why)
            return
        r.last_active = time.monotonic()
        compute = [*w.compute, d.spent]
        if self.output is None:
            dtype = hop_dtype(out, "f32" if r.exact else self.cfg.send_dtype)
            rows = encode_rows(out, dtype)
            act = wire.Activation(
                req=r.req, instance=self.cfg.instance, generation=self.generation,
                pos=w.pos, rows=rows.shape[0], hidden=rows.shape[1], start=w.start,
                compute=compute, dtype=dtype, draft=w.draft,
                draft_by=w.draft_by, epoch=w.epoch,
            )  # fmt: skip
            self.links.send(r.route[self.cfg.stage + 1], act, rows.data)
            return
        nxt = self.output.after(r, w, out, compute)
        if isinstance(nxt, Ended):
            self.end(r, nxt)
        elif nxt is not None:
            self.feed_back(r, *nxt)

    def fault(self, r: Request, why: str) -> None:
        """This stage's output for ``r`` is corrupt: ``r`` ends with a ``stage_fault``
        naming this stage (its API node replays it on a plan without it), and the runner
        says it failed, once: its node gives it up, so the stage moves."""
        where = f"stage {self.cfg.stage} (layers {self.cfg.start}-{self.cfg.end - 1})"
        self.links.fail(r.reply_to, r.req, "stage_fault", f"{where}: {why}", blame=True)
        self.release(r.req, "cancel")
        if not self.faulted:
            self.faulted = why
            log.error("%s computed a corrupt output: %s", where, why)
            emit(Failed(reason=f"{STAGE_FAULT}: {why}"))

    def feed_back(self, r: Request, tok: int, pos: int) -> None:
        """Send the token just drawn to stage 0 (or queue it here), to run at ``pos``:
        a restart, which ends every step sent after the one it came from."""
        r.epoch += 1
        if self.first:
            self.spec.feed(r, tok, pos)
        else:
            self.links.token(r.route[0], r.req, self.generation, tok, pos, r.epoch)

    # -- ending ------------------------------------------------------------------------
    def end(self, r: Request, e: Ended) -> None:
        """End ``r`` as the last stage said: its last chunk (or error), then its
        release. The release message goes at once and the chunk at the next flush, so
        stage 0 keeps the answer's KV before the client's next turn can reach it."""
        if e.error is not None:
            self.links.fail(r.reply_to, r.req, *e.error)
        elif e.chunk is not None:
            self.links.chunk(r.reply_to, e.chunk)
        self.release(r.req, e.reason, e.n_kv)

    def release(self, req: str, reason: str, n_kv: int = -1) -> None:
        """Free ``req`` here and pass the release down the chain (see
        :meth:`Requests.release`); a freed seat goes to the next request waiting."""
        if self.requests.release(req, reason, n_kv) is not None:
            self.report_load()
            self.admit_waiting()

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
        self.seats.drop_all_kept()
        stale = [r for r in self.reqs.values() if r.generation != generation]
        for r in stale:
            self.links.fail(r.reply_to, r.req, "generation_mismatch",
                            "plan changed during the request")  # fmt: skip
            self.requests.free(r)
        if stale:
            self.report_load()
            self.counters.superseded += len(stale)
            log.info("plan generation %d: freed %d older request(s)", generation, len(stale))
        for g in self.requests.waiting.drop_generation(generation):
            self.refuse_generation(g)
        self.admit_waiting()

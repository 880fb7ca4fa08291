"""A runner: one pipeline stage of one model instance, in its own process.

The node's supervisor starts ``python -m meshd.engines.runner CONFIG_JSON``. The runner
binds a ROUTER on an OS-chosen port and reports on stdout, one JSON object a line:
``{"event": "listening", "port": N}``, then ``{"event": "ready"}`` or
``{"event": "failed", "reason": "..."}``. It reads control lines on stdin
(``{"cmd": "generation", "value": G}``; EOF means the node is gone: exit).

Data plane (all messages carry the request id and the plan generation):

* stage 0 gets ``Generate``: renders the chat template, tokenizes, checks the context,
  sends the API node a ``DataChunk(n_prompt=...)``, then runs its layers;
* a middle stage gets ``Activation`` (hidden rows in a raw float32 frame) and passes
  its own on;
* the last stage samples, sends text to the API node (``DataChunk``) and the token back
  to stage 0 (``Token``), until the request finishes; then ``Release`` walks the chain.

Requests in flight are batched: one engine call per step serves every request that
has work, so several streams keep every stage busy. The loop is plain synchronous
Python: compute blocks, and nothing else shares this process.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import zmq

from meshd.transport import wire
from meshd.transport.addresses import local_addresses
from meshd.transport.dataplane import endpoint
from meshd.transport.security import (
    HANDSHAKE_EVENTS,
    ClusterKeys,
    HandshakeReporter,
    SecretError,
    derive_keys,
    load_secret,
    secure,
    start_zap,
)
from meshd.transport.tensors import TensorError, decode_rows, encode_rows

from .llama_stage import StageInput

log = logging.getLogger("meshd.runner")

#: Connections a runner keeps to other runners and API nodes (least recently used go).
MAX_DEALERS = 64


class RunnerConfig(msgspec.Struct, kw_only=True):
    """Everything a runner needs, passed as JSON on its command line."""

    instance: str
    generation: int
    stage: int
    n_stages: int
    model_path: str
    sha256: str
    start: int
    end: int
    n_layers: int
    engine: str = "llama_cpp"
    cache_dir: str
    bind_host: str = "0.0.0.0"
    n_ctx: int = 4096
    n_seq_max: int = 8
    exact: bool = False
    n_threads: int | None = None
    #: Wire type of the activations this stage sends on (see transport.tensors);
    #: anything but f32 only between two MLX stages (InstanceSpec.activations).
    send_dtype: str = "f32"


def emit(event: str, **kw: object) -> None:
    """One status line for the supervisor."""
    sys.stdout.write(json.dumps({"event": event, **kw}) + "\n")
    sys.stdout.flush()


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
    # Last stage only:
    sampler: object | None = None
    detok: object | None = None
    stopper: object | None = None


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


@dataclass
class Counters:
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)


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
        self.own = local_addresses()
        self.reqs: dict[str, Request] = {}
        self.free_seqs = list(range(cfg.n_seq_max - 1, -1, -1))
        self.waiting: collections.deque[wire.Generate] = collections.deque()
        self.work: collections.deque[Work] = collections.deque()
        self.dealers: dict[str, zmq.Socket] = {}
        self.counters = Counters()
        self.template = template
        self._endpoints: dict[tuple, str] = {}
        self.bos_text = ""
        self.eos_text = ""
        self.eos: set[int] = set(stage.eos_tokens()) if self.last else set()

    # -- sockets -------------------------------------------------------------------
    def send(self, addr: wire.Addr, msg: wire.Message, *frames) -> None:
        key = (addr.port, *addr.addresses)
        ep = self._endpoints.get(key)
        if ep is None:
            # Resolved once per address, not per token.
            ep = self._endpoints[key] = endpoint(addr, self.own)
        d = self.dealers.pop(ep, None)
        if d is None:
            if len(self.dealers) >= MAX_DEALERS:
                # Least recently used first: a flood of made-up reply addresses must not
                # use up ZeroMQ's sockets (1023) nor keep dead peers being redialled.
                self.dealers.pop(next(iter(self.dealers))).close(linger=0)
            d = self.ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.SNDHWM, 10000)
            secure(d, self.keys, server=False)
            try:
                d.connect(ep)
            except zmq.ZMQError:
                d.close(linger=0)
                raise
        self.dealers[ep] = d  # (re)inserted last: the most recently used
        try:
            d.send_multipart([wire.encode(msg), *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.counters.dropped["send_queue_full"] += 1

    def chunk(self, r: Request | None, reply_to: wire.Addr, req: str, **kw) -> None:
        self.send(reply_to, wire.DataChunk(req=req, **kw))

    def fail(self, reply_to: wire.Addr, req: str, code: str, message: str) -> None:
        self.send(
            reply_to, wire.DataChunk(req=req, error=wire.ChunkError(code=code, message=message))
        )

    # -- loop ----------------------------------------------------------------------
    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(sys.stdin.fileno(), zmq.POLLIN)
        mon = None
        if self.keys is not None:
            mon = self.router.get_monitor_socket(HANDSHAKE_EVENTS)
            poller.register(mon, zmq.POLLIN)
            reporter = HandshakeReporter(lambda _s, reason: self.counters.dropped.update([reason]))
        while True:
            timeout = 0 if self.work else 200
            events = dict(poller.poll(timeout))
            if self.router in events:
                self.drain()
            if mon is not None and mon in events:
                reporter.event("stage", mon.recv_multipart())
            if sys.stdin.fileno() in events and not self.control():
                return
            if self.work:
                self.step()

    def control(self) -> bool:
        """Handle one stdin line; False when the node closed stdin (it is gone)."""
        r, _, _ = select.select([sys.stdin], [], [], 0)
        if not r:
            return True
        line = sys.stdin.readline()
        if not line:
            return False
        try:
            cmd = json.loads(line)
        except ValueError:
            return True
        if cmd.get("cmd") == "generation":
            self.generation = int(cmd["value"])
            emit("generation", value=self.generation)
        elif cmd.get("cmd") == "stop":
            return False
        return True

    def drain(self) -> None:
        # Ask the socket whether input waits rather than catch zmq.Again: the exception
        # cost showed on every hop's profile.
        router = self.router
        while router.get(zmq.EVENTS) & zmq.POLLIN:
            frames = router.recv_multipart(copy=False)
            if len(frames) < 2:
                self.counters.dropped["shape"] += 1
                continue
            try:
                msg = wire.decode(frames[1].buffer, wire.MAX_DATA_FRAME)
            except wire.FrameError as e:
                self.counters.dropped[e.reason] += 1
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
                self.fail(
                    msg.reply_to, msg.req, "generation_mismatch",
                    f"plan generation {msg.generation} != runner generation {self.generation}",
                )  # fmt: skip
            elif self.free_seqs:
                self.admit(msg)
            else:
                self.waiting.append(msg)
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
            if msg.req in self.reqs:
                self.work.append(Work(msg.req, msg.pos, tokens=np.array([msg.token], np.int32)))
            else:
                self.counters.dropped["unknown_request"] += 1
        elif isinstance(msg, wire.Release):
            self.release(msg.req, msg.reason)
        else:
            self.counters.dropped["unexpected"] += 1

    def report_load(self) -> None:
        """Tell the supervisor how many requests hold KV here (it shows in the heartbeat)."""
        emit("load", active=len(self.reqs))

    # -- stage 0 -------------------------------------------------------------------
    def admit(self, g: wire.Generate) -> None:
        try:
            prompt = self.tokenize(g)
        except Exception as e:
            self.fail(g.reply_to, g.req, "bad_prompt", f"cannot tokenize the prompt: {e}")
            return
        n = len(prompt)
        if n == 0:
            self.fail(g.reply_to, g.req, "bad_prompt", "the prompt is empty")
            return
        # A replay re-prefills the prompt plus the tokens the client already has.
        resume = list(g.resume_tokens)
        total = n + len(resume)
        if total >= self.cfg.n_ctx:
            self.fail(
                g.reply_to, g.req, "context_length_exceeded",
                f"this model's context is {self.cfg.n_ctx} tokens; the prompt has {total}",
            )  # fmt: skip
            return
        seq = self.free_seqs.pop()
        r = Request(g.req, seq, list(g.route), g.reply_to, g.sampling, n_prompt=n)
        self.reqs[g.req] = r
        self.report_load()
        self.chunk(r, g.reply_to, g.req, n_prompt=n)
        start = wire.Start(
            route=r.route, reply_to=r.reply_to, sampling=r.sampling, n_prompt=n, resume=resume
        )
        if self.last:
            self.init_last(r, resume)
        tokens = np.asarray(prompt + resume, np.int32)
        self.work.append(Work(g.req, 0, tokens=tokens, start=start))

    def tokenize(self, g: wire.Generate) -> list[int]:
        if g.messages is not None:
            from .chat import render_chat

            text = render_chat(
                self.template or _CHATML,
                [{"role": m.role, "content": m.content} for m in g.messages],
                add_generation_prompt=True,
            )
            return list(self.stage.tokenize(text, add_special=True, parse_special=True))
        return list(self.stage.tokenize(g.prompt or "", add_special=True, parse_special=False))

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
            if not self.free_seqs:
                self.fail(a.start.reply_to, a.req, "overloaded", "stage has no free sequence")
                return
            s = a.start
            r = Request(
                a.req, self.free_seqs.pop(), list(s.route), s.reply_to, s.sampling, s.n_prompt
            )
            self.reqs[a.req] = r
            self.report_load()
            if self.last:
                self.init_last(r, s.resume)
        self.work.append(Work(a.req, a.pos, hidden=hidden, start=a.start, compute=a.compute))

    def forward_one(self, w: Work, item):
        """One item alone; on failure end its request with ``bad_input`` and None."""
        try:
            return self.stage.forward([item])[0]
        except Exception as e:
            log.warning("request %s failed at this stage: %s", w.req, e)
            r = self.reqs[w.req]
            self.fail(r.reply_to, r.req, "bad_input", f"stage {self.cfg.stage}: {e}")
            self.release(r.req, "cancel")
            return None

    def init_last(self, r: Request, resume: list[int]) -> None:
        """Sampling state of a request; a replay primes it with the tokens already sent,
        so held-back UTF-8 bytes and partial stop strings continue exactly."""
        from .detok import IncrementalDetokenizer, StopMatcher
        from .sampling import Sampler, SamplingParams

        s = r.sampling
        r.sampler = Sampler(
            SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)
        )
        r.detok = IncrementalDetokenizer(self.stage.token_to_piece)
        r.stopper = StopMatcher(list(s.stop))
        for tok in resume:
            r.stopper.push(r.detok.push(tok))
        r.n_generated = len(resume)

    # -- compute -------------------------------------------------------------------
    def step(self) -> None:
        """One engine call over every request that has work queued (one item each)."""
        batch: list[Work] = []
        seen: set[str] = set()
        rest: collections.deque[Work] = collections.deque()
        while self.work:
            w = self.work.popleft()
            if w.req not in self.reqs:
                continue  # released while queued
            if w.req in seen:
                rest.append(w)
            else:
                seen.add(w.req)
                batch.append(w)
        self.work = rest
        if not batch:
            return
        items = [
            StageInput(seq=self.reqs[w.req].seq, pos=w.pos, tokens=w.tokens, hidden=w.hidden)
            for w in batch
        ]
        t0 = time.perf_counter()
        try:
            outs: list = self.stage.forward(items)
        except Exception:
            # One bad item fails the whole call: run them one by one so only the
            # requests at fault end (with a typed error), and the runner lives on.
            outs = [self.forward_one(w, it) for w, it in zip(batch, items, strict=True)]
        spent = round(time.perf_counter() - t0, 6)
        for w, out in zip(batch, outs, strict=True):
            if out is None:
                continue
            r = self.reqs[w.req]
            n = len(w.tokens) if w.tokens is not None else len(w.hidden)  # type: ignore[arg-type]
            if not self.last:
                rows = encode_rows(out, self.cfg.send_dtype)
                act = wire.Activation(
                    req=r.req, instance=self.cfg.instance, generation=self.generation,
                    pos=w.pos, rows=rows.shape[0], hidden=rows.shape[1], start=w.start,
                    compute=[*w.compute, spent], dtype=self.cfg.send_dtype,
                )  # fmt: skip
                self.send(r.route[self.cfg.stage + 1], act, memoryview(rows))
            else:
                self.sample(r, out, w.pos + n, [*w.compute, spent])

    def sample(self, r: Request, logits: np.ndarray, next_pos: int, compute: list[float]) -> None:
        tok = int(r.sampler.sample(logits))  # type: ignore[attr-defined]
        r.n_generated += 1
        finish = None
        text = ""
        if tok in self.eos and not r.sampling.ignore_eos:
            finish = "stop"
        else:
            piece = r.detok.push(tok)  # type: ignore[attr-defined]
            text, stopped = r.stopper.push(piece)  # type: ignore[attr-defined]
            if stopped:
                finish = "stop"
            elif (
                r.sampling.max_tokens is not None and r.n_generated >= r.sampling.max_tokens
            ) or next_pos + 1 >= self.cfg.n_ctx:
                finish = "length"
        if finish is not None:
            if finish == "length":
                text += r.stopper.push(r.detok.flush())[0] + r.stopper.flush()  # type: ignore[attr-defined]
            usage = wire.Usage(r.n_prompt, r.n_generated)
            self.chunk(
                r, r.reply_to, r.req, text=text, tokens=[tok], finish_reason=finish, usage=usage
            )
            self.release(r.req, "done")
            return
        self.chunk(r, r.reply_to, r.req, text=text, tokens=[tok], compute=compute)
        if self.first:
            self.work.append(Work(r.req, next_pos, tokens=np.array([tok], np.int32)))
        else:
            self.send(
                r.route[0],
                wire.Token(req=r.req, instance=self.cfg.instance, generation=self.generation,
                           token=tok, pos=next_pos),
            )  # fmt: skip

    def release(self, req: str, reason: str) -> None:
        """Free ``req`` here and pass the release down the chain."""
        r = self.reqs.pop(req, None)
        if r is None:
            return
        self.stage.free(r.seq)
        self.free_seqs.append(r.seq)
        self.report_load()
        nxt = self.cfg.stage + 1
        if self.last and not self.first and reason == "done":
            # The last stage finished the request: start the release walk at stage 0.
            self.send(r.route[0], wire.Release(req=req, instance=self.cfg.instance, reason=reason))
        elif nxt < self.cfg.n_stages and (reason == "cancel" or nxt < self.cfg.n_stages - 1):
            self.send(
                r.route[nxt], wire.Release(req=req, instance=self.cfg.instance, reason=reason)
            )
        while self.waiting and self.free_seqs:
            self.admit(self.waiting.popleft())


_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a runner process."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname).1s runner[{os.getpid()}]: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    cfg = msgspec.json.decode(argv[0], type=RunnerConfig)
    ctx = zmq.Context()
    try:
        secret = load_secret(None)
    except SecretError as e:
        emit("failed", reason=str(e))
        return 1
    keys = None if secret is None else derive_keys(secret)
    if keys is not None:
        start_zap(ctx, keys, lambda: log.warning("refused a peer whose key is not the cluster's"))
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_DATA_FRAME)
    secure(router, keys, server=True)
    host = f"[{cfg.bind_host}]" if ":" in cfg.bind_host else cfg.bind_host
    port = router.bind_to_random_port(f"tcp://{host}")
    emit("listening", port=port)
    try:
        stage = load_stage(cfg)
        template = None
        if cfg.stage == 0:
            from .models import chat_template_at

            template = chat_template_at(cfg.model_path)
    except Exception as e:
        log.exception("could not load the stage")
        emit("failed", reason=f"{type(e).__name__}: {e}")
        return 1
    emit("ready")
    try:
        Runner(cfg, stage, ctx, router, template, keys).serve()
    except KeyboardInterrupt:
        pass
    finally:
        router.close(linger=0)
    return 0


def load_stage(cfg: RunnerConfig):
    """Load this stage's layers in its engine (a llama.cpp slice, or MLX on the GGUF)."""
    first, last = cfg.stage == 0, cfg.stage == cfg.n_stages - 1
    if cfg.engine == "mlx":
        from .mlx_stage import MlxStage

        return MlxStage(
            Path(cfg.model_path), start=cfg.start, end=cfg.end, first=first, last=last,
            n_ctx=cfg.n_ctx, n_seq_max=cfg.n_seq_max, exact=cfg.exact,
        )  # fmt: skip
    if cfg.engine != "llama_cpp":
        raise ValueError(f"engine {cfg.engine!r} is not available in this runner")
    from .llama_stage import LlamaStage, configure_threads
    from .slicing import slice_gguf

    configure_threads()
    path = slice_gguf(Path(cfg.model_path), cfg.start, cfg.end, Path(cfg.cache_dir), cfg.sha256)
    return LlamaStage(
        path, first=first, last=last, n_ctx=cfg.n_ctx, n_seq_max=cfg.n_seq_max,
        exact=cfg.exact, n_threads=cfg.n_threads,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

"""The latency one pipeline hop adds, meshd's transport against bare pyzmq, on loopback.

    python bench/hop.py                       # 10000 round trips each, about 15 s
    python bench/hop.py --rounds 10000 --rows 8

A hop carries one decode step's activation: ``--rows`` float32 rows of the model's
hidden size (the default model: 576, so 2304 bytes per row) from one stage's process to
the next one's. Both subjects use the same topology as meshd's data plane: each process
receives on a ROUTER it binds and sends through a DEALER connected to the other's
ROUTER, over TCP on 127.0.0.1.

* **meshd**: the relay process runs meshd's own runner loop
  (``meshd.engines.runner.Runner``: poll, drain, ``wire.decode``, ``decode_rows``,
  batch, step, ``encode_rows``, ``wire.encode``, send) around a stage whose forward pass
  is the identity (no compute), as the middle stage of a 3-stage route. This process
  sends ``Activation`` messages and reads the ones the relay passes on, with the same
  codec.
* **bare**: the relay does ``recv_multipart`` on its ROUTER and sends the payload bytes
  on through its DEALER; this process sends raw bytes.

One hop = round trip / 2. The two subjects alternate in blocks so that load from
elsewhere hits both alike. Prints p50, p90 and p99 of each, meshd minus bare, and the
codec cost alone. ``MESHD_HOP_PROFILE=FILE`` writes a cProfile of the meshd relay's
loop there. A benchmark: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq
from _common import DEFAULT_MODEL, PROCS, cpu_busy, log, stop_process, table

from meshd.domain.sampling import Sampling

GOAL_US = 100.0


# -- the relay process ----------------------------------------------------------------


class IdentityStage:
    """A middle stage with no compute: its output rows are its input rows."""

    n_vocab = 0
    n_ctx_train = 0
    kept_rows = None
    generative = True

    def __init__(self, hidden: int) -> None:
        self.hidden_size = hidden

    def forward(self, items):
        return [it.hidden for it in items]

    def eos_tokens(self) -> set[int]:
        return set()

    def free(self, seq: int) -> None:
        pass


def relay_main(kind: str, hidden: int) -> int:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    if kind == "bare":
        print(json.dumps({"port": port}), flush=True)
        back = int(sys.stdin.readline())
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{back}")
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(sys.stdin.fileno(), zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if router in events:
                frames = router.recv_multipart(copy=False)
                dealer.send(frames[-1], copy=False)
            if sys.stdin.fileno() in events and not sys.stdin.readline():
                return 0
    from meshd.engines.protocol import RunnerConfig
    from meshd.engines.runner import Runner, StdinLines
    from meshd.transport import wire

    router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_DATA_FRAME)
    cfg = RunnerConfig(
        instance="hop", generation=1, stage=1, n_stages=3, model_path="-", sha256="0" * 64,
        start=0, end=1, n_layers=3, cache_dir=tempfile.gettempdir(), bind_host="127.0.0.1",
    )  # fmt: skip
    print(json.dumps({"port": port}), flush=True)
    sys.stdin.readline()  # the same handshake as the bare relay (the port is in Start)
    # Status lines (load reports) go to stderr: stdout carried the port only.
    sys.stdout = sys.stderr
    runner = Runner(cfg, IdentityStage(hidden), ctx, router)
    prof = os.environ.get("MESHD_HOP_PROFILE")
    if not prof:
        runner.serve(StdinLines())  # until stdin closes
        return 0
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.runcall(runner.serve, StdinLines())
    with open(prof, "w") as f:
        pstats.Stats(pr, stream=f).sort_stats("tottime").print_stats(25)
    return 0


class Relay:
    def __init__(self, kind: str, hidden: int, back_port: int, tmp: Path) -> None:
        args = [sys.executable, str(Path(__file__).resolve()), "--relay", kind,
                "--hidden", str(hidden)]  # fmt: skip
        with open(tmp / f"relay-{kind}.log", "wb") as err:
            self.p = subprocess.Popen(
                args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True,
            )  # fmt: skip
        PROCS.append(self.p)
        assert self.p.stdout is not None and self.p.stdin is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{kind} relay exited {self.p.wait()}; see {tmp}")
        self.port = int(json.loads(line)["port"])
        self.p.stdin.write(f"{back_port}\n")
        self.p.stdin.flush()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.p.stdin is not None
            self.p.stdin.close()
            self.p.wait(3)
        stop_process(self.p)


# -- this side ------------------------------------------------------------------------------


class Side:
    """This process's ROUTER (where hops come back) and DEALER (to the relay)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.SNDHWM, 10000)

    def connect(self, port: int) -> None:
        self.dealer.connect(f"tcp://127.0.0.1:{port}")

    def close(self) -> None:
        self.dealer.close(0)
        self.router.close(0)


def bare_round(side: Side, payload: bytes) -> float:
    t0 = time.perf_counter()
    side.dealer.send(payload, copy=False)
    frames = side.router.recv_multipart(copy=False)
    t1 = time.perf_counter()
    assert len(frames[-1].buffer) == len(payload)
    return t1 - t0


class MeshdSender:
    """Activations as stage 0 sends them; replies read as a stage reads them."""

    def __init__(self, side: Side, relay_port: int, rows: int, hidden: int) -> None:
        from meshd.transport import tensors, wire

        self.wire, self.tensors, self.side = wire, tensors, side
        me = wire.Addr(node="bench", addresses=["127.0.0.1"], port=side.port)
        relay = wire.Addr(node="relay", addresses=["127.0.0.1"], port=relay_port)
        self.route = [me, relay, me]
        self.rows = np.random.default_rng(0).standard_normal((rows, hidden), dtype=np.float32)
        self.pos = 0
        self.req = "hop-0"
        self.first = True

    def round(self) -> float:
        wire, tensors = self.wire, self.tensors
        start = None
        if self.first:
            start = wire.Start(
                route=self.route, reply_to=self.route[0], n_prompt=1,
                sampling=Sampling(temperature=0.0),
            )  # fmt: skip
            self.first = False
        t0 = time.perf_counter()
        rows = tensors.encode_rows(self.rows, "f32")
        act = wire.Activation(
            req=self.req, instance="hop", generation=1, pos=self.pos, rows=rows.shape[0],
            hidden=rows.shape[1], start=start, compute=[0.0],
        )  # fmt: skip
        self.side.dealer.send_multipart([wire.encode(act), memoryview(rows)], copy=False)
        frames = self.side.router.recv_multipart(copy=False)
        msg = wire.decode_stage(frames[1].buffer)
        out = tensors.decode_rows(frames[2].buffer, msg.dtype, msg.rows, msg.hidden)
        t1 = time.perf_counter()
        assert isinstance(msg, wire.Activation) and out.shape == self.rows.shape
        self.pos += self.rows.shape[0]
        if self.pos >= 4000:  # stay inside a context's worth of positions
            self.pos = 0
        return t1 - t0

    def codec(self, n: int) -> float:
        """Seconds per hop of meshd's codec alone (encode + decode, no socket)."""
        wire, tensors = self.wire, self.tensors
        t0 = time.perf_counter()
        for _ in range(n):
            rows = tensors.encode_rows(self.rows, "f32")
            act = wire.Activation(
                req=self.req, instance="hop", generation=1, pos=1, rows=rows.shape[0],
                hidden=rows.shape[1], compute=[0.0],
            )  # fmt: skip
            head, body = wire.encode(act), memoryview(rows).cast("B")
            msg = wire.decode_stage(head)
            tensors.decode_rows(body, msg.dtype, msg.rows, msg.hidden)
        return (time.perf_counter() - t0) / n


def hidden_size(model: str) -> int:
    """``{arch}.embedding_length`` from the model's GGUF header."""
    import gguf

    from meshd.models.resolve import resolve_model

    r = gguf.GGUFReader(resolve_model(model).path)
    arch = r.fields["general.architecture"].contents()
    return int(r.fields[f"{arch}.embedding_length"].contents())


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10000, help="round trips each (default 10000)")
    p.add_argument("--rows", type=int, default=1, help="rows per hop (default 1: decode)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="whose hidden size (default %(default)s)")
    p.add_argument("--hidden", type=int, help="hidden size (default: the model's)")
    p.add_argument("--blocks", type=int, default=10, help="alternating blocks (default 10)")
    p.add_argument("--relay", choices=["meshd", "bare"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.relay:
        return relay_main(args.relay, args.hidden)
    hidden = args.hidden or hidden_size(args.model)

    busy = cpu_busy(0.5)
    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="meshd-hop-"))
    ctx = zmq.Context()
    sides = {k: Side(ctx) for k in ("meshd", "bare")}
    relays: dict[str, Relay] = {}
    samples: dict[str, list[float]] = {"meshd": [], "bare": []}
    codec_s = float("nan")
    t_run = time.perf_counter()
    try:
        for kind, side in sides.items():
            relays[kind] = Relay(kind, hidden, side.port, tmp)
            side.connect(relays[kind].port)
        sender = MeshdSender(sides["meshd"], relays["meshd"].port, args.rows, hidden)
        payload = sender.rows.tobytes()
        rounds = {
            "meshd": sender.round,
            "bare": lambda: bare_round(sides["bare"], payload),
        }
        log(f"hidden {hidden} x {args.rows} row(s) = {len(payload)} B per hop; warm-up")
        for fn in rounds.values():
            for _ in range(200):
                fn()
        per_block = max(1, args.rounds // args.blocks)
        for b in range(args.blocks):
            for kind in ("meshd", "bare") if b % 2 == 0 else ("bare", "meshd"):
                fn = rounds[kind]
                samples[kind] += [fn() / 2 for _ in range(per_block)]
        codec_s = sender.codec(2000)
    except (Exception, KeyboardInterrupt) as e:
        print(f"hop benchmark stopped: {type(e).__name__}: {e}; logs in {tmp}", file=sys.stderr)
    finally:
        for r in relays.values():
            r.close()
        for s in sides.values():
            s.close()
        ctx.term()

    if not samples["meshd"] or not samples["bare"]:
        return 0
    us = {k: [1e6 * x for x in v] for k, v in samples.items()}
    print()
    print(
        f"One pipeline hop on loopback (round trip / 2), {hidden} x {args.rows} float32 = "
        f"{hidden * args.rows * 4} B; {len(us['meshd'])} hops each, alternating in "
        f"{args.blocks} blocks"
    )
    print(
        f"load average {load[0]:.2f} at start ({100 * busy:.0f}% of the CPUs busy), "
        f"{os.cpu_count()} CPUs"
    )
    rows = []
    for kind, label in (
        ("meshd", "meshd transport (runner loop + wire codec)"),
        ("bare", "bare pyzmq DEALER/ROUTER"),
    ):
        xs = us[kind]
        rows.append([label, f"{pct(xs, 50):.1f}", f"{pct(xs, 90):.1f}", f"{pct(xs, 99):.1f}"])
    diff = [pct(us["meshd"], q) - pct(us["bare"], q) for q in (50, 90, 99)]
    rows.append(["meshd - bare (added by meshd)", *(f"{d:.1f}" for d in diff)])
    rows.append(["  of which the codec alone (encode + decode)", f"{1e6 * codec_s:.1f}", "", ""])
    print(table(rows, ["per hop", "p50 us", "p90 us", "p99 us"]))
    m50 = pct(us["meshd"], 50)
    print()
    print(
        f"goal: one hop <= {GOAL_US:.0f} us p50 on loopback: meshd {m50:.1f} us -> "
        f"{'met' if m50 <= GOAL_US else 'NOT met'}; meshd's share over bare pyzmq "
        f"{diff[0]:.1f} us -> {'met' if diff[0] <= GOAL_US else 'NOT met'}"
    )
    print(f"total run time {time.perf_counter() - t_run:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

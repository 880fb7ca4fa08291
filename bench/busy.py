"""Decode speed on a busy machine / on a quiet one: meshd against plain llama-cpp-python.

    python bench/busy.py                 # 3 rounds, 64 tokens
    python bench/busy.py --rounds 5 --tokens 128 --keep-logs
    python bench/busy.py --rounds 1 --tokens 32 --skip-all-cores   # a quick look

One ``meshd up`` node serving the default model (whole, 1 stage, its threads left to
meshd: ``MESHD_THREADS`` unset, ``GOMP_SPINCOUNT`` as meshd sets it), and
llama-cpp-python in a worker process on the same GGUF with its default threads (and
with every core, as a whole-model runner would start), both with a whole-model
runner's OpenMP environment. Each round measures every subject quiet, then with a
competing CPU-bound process (``while True: pass``, not niced) pinned to the first core
this process may use, started 2 s before the subject's streams (meshd's threads adapt
within that), then quiet again; each quiet stream after 3 s of quiet (meshd takes a
thread back after 2 s of a free core). A stream: one greedy request of ``--tokens`` tokens;
decode tok/s from the first token to the last. The figure: busy / quiet decode per
subject (median over the rounds). Issue 36's goal for meshd: >= 0.4 (0.02 before
meshd's threads followed the free cores).

The machine's other load is measured over each phase (CPU of processes outside this
bench's tree, as a share of all CPUs) and printed: a figure taken while someone's tests
ran (``pgrep -f ci/run``) says little. A benchmark: it prints and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from _common import (
    DEFAULT_MODEL,
    N_CTX,
    PROCS,
    OthersMeter,
    Stream,
    WorkerProc,
    add_worker_args,
    chat_payload,
    http_client,
    place,
    run_measure,
    start_node,
    stop_process,
    stream_chat,
    table,
)

#: Seconds the competitor runs before a subject's streams: meshd samples the free
#: cores every 0.5 s and drops a thread at once.
SETTLE_S = 2.0
#: Seconds of quiet before a quiet stream: meshd takes a thread back only after 4
#: samples in a row (2 s) found a core free for it (meshd/engines/freecores.py), so a
#: stream right after the competitor, or after another subject's, would run on one.
QUIET_S = 3.0


def worker_main(args: argparse.Namespace) -> int:
    """llama-cpp-python holding the model; ``{"tokens": n}`` -> one stream's timings."""
    import llama_cpp

    kw = {"n_threads": args.worker_threads} if args.worker_threads else {}
    llm = llama_cpp.Llama(args.worker_model, n_ctx=N_CTX, verbose=False, **kw)
    prompt = llm.tokenize(b"Write a long story about a robot who learns to paint.")
    print(json.dumps({"threads": llm.context_params.n_threads}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        llm.reset()
        t0, ts = time.perf_counter(), []
        for _ in llm.generate(prompt, temp=0.0):
            ts.append(time.perf_counter())
            if len(ts) >= cmd["tokens"]:
                break
        print(json.dumps({"t_sent": t0, "t_first": ts[0], "t_last": ts[-1],
                          "t_end": ts[-1], "tokens": len(ts)}), flush=True)  # fmt: skip
    return 0


class Direct(WorkerProc):
    def __init__(self, tmp: Path, model_path: str, threads: int) -> None:
        args = ["--worker-model", model_path, "--worker-threads", str(threads)]
        super().__init__(__file__, tmp, args, quit_line='{"quit": true}')

    def stream(self, tokens: int) -> Stream:
        return Stream(**self.ask(json.dumps({"tokens": tokens})), events=tokens)


@contextlib.contextmanager
def competitor() -> Iterator[None]:
    """A CPU-bound process on the first core this process may use, for the block."""
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    PROCS.append(p)
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(p.pid, {cpu})
    try:
        time.sleep(SETTLE_S)
        yield
    finally:
        stop_process(p, grace=1.0)


def ci_running() -> bool:
    r = subprocess.run(["pgrep", "-f", "ci/run"], capture_output=True, check=False)
    return bool(r.stdout.strip())


def measure(tmp: Path, args: argparse.Namespace) -> int:
    from meshd.models import resolve_model

    path = str(resolve_model(DEFAULT_MODEL).path)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cores} cores; CI running: {ci_running()}", flush=True)
    node = start_node(tmp, "busy", "busy")
    client = http_client()
    place(client, node, DEFAULT_MODEL, ["busy"])
    payload = chat_payload(DEFAULT_MODEL, args.tokens, meshd=True)
    default = Direct(tmp, path, 0)
    subjects: dict[str, Callable[[], Stream]] = {
        "meshd (threads follow the free cores)": lambda: stream_chat(client, node.api, payload),
        f"llama-cpp-python, default ({default.info['threads']} threads)":
            lambda: default.stream(args.tokens),
    }  # fmt: skip
    workers = [default]
    if not args.skip_all_cores:
        every = Direct(tmp, path, cores or 1)
        workers.append(every)
        subjects[f"llama-cpp-python, {every.info['threads']} threads"] = lambda: every.stream(
            args.tokens
        )
    for run in subjects.values():
        run()  # warm
    ratios: dict[str, list[float]] = {k: [] for k in subjects}
    raw: dict[str, list[tuple[float, float]]] = {k: [] for k in subjects}
    loads: list[float] = []
    for r in range(args.rounds):
        for name, run in subjects.items():
            time.sleep(QUIET_S)
            meter = OthersMeter()
            quiet = run().decode_tok_s
            loads.append(meter.share())
            with competitor():
                busy = run().decode_tok_s
            time.sleep(QUIET_S)
            quiet = statistics.mean([quiet, run().decode_tok_s])
            raw[name].append((quiet, busy))
            ratios[name].append(busy / quiet)
            print(f"round {r + 1} {name}: quiet {quiet:.1f} tok/s, busy {busy:.1f} tok/s",
                  flush=True)  # fmt: skip
    rows = [
        [name, f"{statistics.median(q for q, _ in raw[name]):.1f}",
         f"{statistics.median(b for _, b in raw[name]):.1f}",
         f"{statistics.median(ratios[name]):.2f}",
         f"{min(ratios[name]):.2f}-{max(ratios[name]):.2f}"]
        for name in subjects
    ]  # fmt: skip
    print()
    print(table(rows, ["subject", "quiet tok/s", "busy tok/s", "busy/quiet", "spread"]))
    print(f"\nother processes' CPU during the quiet streams: median "
          f"{statistics.median(loads):.0%} of all cores; CI running: {ci_running()}")  # fmt: skip
    for w in workers:
        w.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument(
        "--skip-all-cores", action="store_true",
        help="leave out llama-cpp-python on every core (slow on a busy machine: minutes)",
    )  # fmt: skip
    add_worker_args(p)
    args = p.parse_args()
    if args.worker:
        return worker_main(args)
    return run_measure("meshd-busy-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    sys.exit(main())

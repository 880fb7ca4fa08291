#!/usr/bin/env python
"""Under load and faults: streams lost, a lone client's wait, a stopped stage's cost.

Real ``meshd up`` processes on loopback (``tests.cluster``) serving the default model.

(a) 256 concurrent greedy streams on one node from four clients (an API key and a
    loopback address each: 200, 40, 15 and 1 requests): how many were served, refused
    with 429 + Retry-After, or lost (anything else: a 5xx, a cut stream).
(b) A lone client's time to first token, alone (the baseline, in the same run) and
    behind a client with 60 requests in flight: the ratio and the worst of the trials.
(c) 128 concurrent streams through a 2-stage split over two nodes (100, 27, 1).
(d) A stage's runner SIGSTOPped mid-stream (``tests.node.test_stage_faults``'s case):
    the time from the stop to the stream's next token, and whether the text held.

Run: ``python bench/load.py [--trials 5] [--tokens 16]``. Not a test: it prints the
figures and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.models.resolve import DEFAULT_MODEL
from tests import faultlab
from tests.cluster import Cluster, NodeProc, act_as_owner, wait_for, wait_serving
from tests.node.test_load import Outcome, _streams

PROMPTS = ["The capital of France is", "Once upon a time", "List three prime numbers:"]


def _bodies(n: int, tokens: int) -> list[dict]:
    return [{"model": DEFAULT_MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens,
             "temperature": 0, "stream": True, "ignore_eos": True} for i in range(n)]  # fmt: skip


def _src(i: int) -> str:
    return f"127.0.0.{20 + i}"


async def _clients(api: str, sizes: dict[str, int], tokens: int) -> dict[str, list[Outcome]]:
    """Each client's requests at once, all clients together."""
    names = list(sizes)
    got = await asyncio.gather(
        *(_streams(api, _bodies(sizes[k], tokens), key=k, src=_src(i)) for i, k in enumerate(names))
    )
    return dict(zip(names, got, strict=True))


def _outcomes(by_client: dict[str, list[Outcome]], tokens: int) -> str:
    counts: collections.Counter[str] = collections.Counter()
    served = {}
    for k, outs in by_client.items():
        served[k] = 0
        for o in outs:
            whole = o.status == 200 and o.done and o.error is None and o.finish == "length"
            refused = o.status == 429 and o.retry_after is not None
            counts["served" if whole else "429" if refused else "lost"] += 1
            served[k] += whole
    return f"{dict(counts)}, served per client {served}"


def lone_behind(api: str, crowd: int, tokens: int) -> float:
    """A lone client's TTFT (s) behind ``crowd`` requests of another client."""

    async def go() -> float:
        flood = asyncio.create_task(_streams(api, _bodies(crowd, tokens), key="crowd", src=_src(8)))
        if crowd:
            await asyncio.to_thread(
                wait_for, lambda: _in_flight(api) >= min(crowd, 60), 60, 0.02
            )  # fmt: skip
        (lone,) = await _streams(api, _bodies(1, tokens), key="lone", src=_src(9))
        await flood
        assert lone.ttft is not None, lone
        return lone.ttft

    return asyncio.run(go())


def _in_flight(api: str) -> int:
    import httpx

    return int(httpx.get(api + "/healthz", timeout=10).json()["requests_in_flight"])


def stall_trial(cl: Cluster, a: NodeProc, b: NodeProc, tokens: int) -> tuple[float, bool]:
    """SIGSTOP b's runner of a fresh [a, b] plan mid-stream: stop -> next token (s),
    and whether the counting text went on with nothing lost."""
    inst = faultlab.fresh_plan(cl, [a, b])
    (pid,) = faultlab.runner_pids(inst["id"], stage=1)
    events: list[tuple[float, str]] = []
    t = threading.Thread(target=faultlab.stream, args=(a, events, tokens), daemon=True)
    t.start()
    wait_for(lambda: len(events) >= 15, 30, interval=0.01)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    t.join(90)
    after = [at for at, _ in events if at > stopped]
    numbers = [int(x) for x in re.findall(r"\d+", faultlab.text_of(events))]
    ok = numbers == list(range(11, 11 + len(numbers))) and events[-1][1] == "data: [DONE]"
    return (after[0] - stopped if after else float("inf")), ok


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5, help="lone-client and stall trials (5)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per stream (16)")
    args = ap.parse_args(argv)
    act_as_owner()
    with tempfile.TemporaryDirectory(prefix="meshd-load-") as tmp, Cluster(Path(tmp)) as cl:
        a = cl.start("a", model=DEFAULT_MODEL)
        wait_for(lambda: bool(a.get("/v1/instances")["data"]), 90, 0.2)
        wait_serving(a, a.get("/v1/instances")["data"][0]["id"], 90)
        t0 = time.monotonic()
        got = asyncio.run(
            _clients(a.api, {"c200": 200, "c40": 40, "c15": 15, "c1": 1}, args.tokens)
        )
        print(f"(a) 256 streams on one node, {args.tokens} tokens each, "
              f"{time.monotonic() - t0:.1f} s: {_outcomes(got, args.tokens)}")  # fmt: skip
        alone = [lone_behind(a.api, 0, args.tokens) for _ in range(args.trials)]
        behind = [lone_behind(a.api, 60, args.tokens) for _ in range(args.trials)]
        base = statistics.median(alone)
        print(f"(b) a lone client's first token: alone {base:.2f} s (median of {len(alone)}), "
              f"behind 60 requests of another client median {statistics.median(behind):.2f} s, "
              f"worst {max(behind):.2f} s: {statistics.median(behind) / base:.1f}x the "
              f"baseline (the 60 run 8 at a time)")  # fmt: skip
        b = cl.start("b", peers=[a])
        wait_for(lambda: len(a.cluster()["nodes"]) == 2, 15)
        split = faultlab.fresh_plan(cl, [a, b])
        t0 = time.monotonic()
        got = asyncio.run(_clients(a.api, {"c100": 100, "c27": 27, "c1": 1}, args.tokens))
        print(f"(c) 128 streams through a 2-stage split, {time.monotonic() - t0:.1f} s: "
              f"{_outcomes(got, args.tokens)} (instance {split['id']})")  # fmt: skip
        stalls = [stall_trial(cl, a, b, 80) for _ in range(args.trials)]
        times = [s for s, _ in stalls]
        print(f"(d) SIGSTOP of a stage mid-stream -> next token: median "
              f"{statistics.median(times):.1f} s, worst {max(times):.1f} s; text whole in "
              f"{sum(ok for _, ok in stalls)}/{len(stalls)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

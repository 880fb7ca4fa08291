"""Many users at once: aggregate decode of a 2-stage split against one node, each node
pinned to a core of its own.

    python bench/many_users.py                      # 1, 8 and 16 streams, 64 tokens
    python bench/many_users.py --streams 1,16 --tokens 32 --rounds 1
    PYTHONPATH=/tmp/base python bench/many_users.py # another tree's meshd, same bench

Three ``meshd up`` nodes on loopback serving the default model, each under ``taskset``
so that two nodes act as two machines: ``one`` (a cluster of its own, the whole model,
on the first CPU) and ``a`` -> ``b`` (a 2-stage split, a on the first CPU, b on the
second). Both instances hold ``--seats`` requests (16: every stream has a sequence)
and do not speculate (drafts would measure the proposer, not the pipeline). Only one
subject streams at a time.

At each concurrency, ``n`` greedy chat streams start together, each its own short
prompt (``cache_prompt: false``: no kept prefix), ``--tokens`` tokens with
``ignore_eos``. The figure: aggregate tok/s (every stream's tokens over the wall time
from the first request sent to the last token), and split / one node, the same run.
Issue 36's goal at 16 streams: >= 1.6. A benchmark: it prints figures and exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEFAULT_MODEL,
    READY,
    HttpError,
    Node,
    OthersMeter,
    Proc,
    chat_payload,
    http_client,
    meshd_command,
    run_concurrent,
    table,
    wait_instance_ready,
    wait_live,
)

#: Distinct short questions: stream i asks PROMPTS[i % len] with its number.
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle gear works.",
    "Describe a walk through an autumn forest.",
    "Tell me about the history of bread.",
    "Write a poem about the sea at night.",
    "Explain why the sky is blue.",
    "Describe a busy market in the morning.",
    "Tell a story about a cat who learns to fly.",
]


def start_pinned(tmp: Path, name: str, cluster: str, cpu: int, peer: Node | None = None) -> Node:
    """``meshd up`` on loopback under ``taskset -c cpu`` (its runners inherit the CPU)."""
    from meshd.transport.security import write_secret

    secret = tmp / f"{cluster}.secret"
    if not secret.exists():
        write_secret(secret)
    args = [
        "taskset", "-c", str(cpu), *meshd_command(), "up", "--name", name,
        "--cluster", cluster, "--no-model", "--no-discovery", "--api-port", "0",
        "--mesh-port", "0", "--mesh-host", "127.0.0.1",
        "--data-dir", str(tmp / f"data-{name}"), "--secret-file", str(secret),
        # 16 prompts on one busy core may take longer than the default silence.
        "--chunk-timeout", "600",
    ]  # fmt: skip
    if peer is not None:
        args += ["--peer", f"127.0.0.1:{peer.mesh_port}"]
    proc = Proc(args, tmp / f"node-{name}.log")
    _, m = proc.wait_line(READY, 300.0)
    return Node(name, proc, m["api"], int(m["mesh"]))


def place(client: Any, node: Node, nodes: list[str], seats: int) -> None:
    """The default model, a stage on each of ``nodes``, ``seats`` requests in flight."""
    body = {"model": DEFAULT_MODEL, "nodes": nodes, "seats": seats, "speculate": False}
    deadline = time.monotonic() + 300.0
    while True:
        try:
            r = client.post(f"{node.api}/v1/instances", json=body)
        except httpx.TransportError:  # a node this busy may drop a connection
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
            continue
        # A node's card names its backends once it has probed them (slow on a busy box).
        if r.status_code != 409 or "no_backend" not in r.text or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if r.status_code >= 300:
        raise HttpError(r.status_code, r.text)
    iid = r.json()["id"]
    wait_instance_ready(client, node, iid, 300.0)
    stages = client.get(f"{node.api}/v1/instances/{iid}").json()["stages"]
    if len(stages) != len(nodes):
        raise RuntimeError(f"asked for {len(nodes)} stage(s) on {nodes}, got {stages}")


def payloads(n: int, tokens: int) -> list[dict[str, Any]]:
    """``n`` greedy streams, each its own prompt, no kept prefix."""
    out = []
    for i in range(n):
        text = f"{PROMPTS[i % len(PROMPTS)]} (reader {i})"
        p = chat_payload(DEFAULT_MODEL, tokens, meshd=True,
                         messages=[{"role": "user", "content": text}])  # fmt: skip
        p["cache_prompt"] = False
        out.append(p)
    return out


def measure(tmp: Path, args: argparse.Namespace) -> int:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("needs 2 CPUs (a node on each)")
        return 0
    c0, c1 = cpus[0], cpus[1]
    print(f"CPUs: one and a on {c0}, b on {c1}; seats {args.seats}", flush=True)
    one = start_pinned(tmp, "one", "one", c0)
    a = start_pinned(tmp, "a", "split", c0)
    start_pinned(tmp, "b", "split", c1, peer=a)
    client = http_client(600.0)
    wait_live(client, a, {"a", "b"}, 60.0)
    place(client, one, ["one"], args.seats)
    place(client, a, ["a", "b"], args.seats)
    subjects = {"one node": one.api, "2 stages": a.api}
    for base in subjects.values():
        run_concurrent(base, payloads(1, 8), 1)  # warm
    streams = [int(s) for s in args.streams.split(",")]
    agg: dict[tuple[str, int], list[float]] = {}
    loads = []
    for r in range(args.rounds):
        for n in streams:
            for name, base in subjects.items():
                meter = OthersMeter()
                got = run_concurrent(base, payloads(n, args.tokens), n)
                loads.append(meter.share())
                agg.setdefault((name, n), []).append(got.agg_tok_s)
                per = statistics.median(s.decode_tok_s for s in got.streams)
                print(f"round {r + 1}, {n} streams, {name}: {got.agg_tok_s:.1f} tok/s "
                      f"aggregate, {per:.1f} per stream, {got.wall:.1f} s", flush=True)  # fmt: skip
    rows = []
    for n in streams:
        o = statistics.median(agg[("one node", n)])
        s = statistics.median(agg[("2 stages", n)])
        rows.append([str(n), f"{o:.1f}", f"{s:.1f}", f"{s / o:.2f}"])
    print()
    print(table(rows, ["streams", "one node tok/s", "2 stages tok/s", "2 stages / one"]))
    print(f"\nother processes' CPU while streaming: median {statistics.median(loads):.0%} "
          f"of all cores")  # fmt: skip
    return 0


def main() -> int:
    from _common import run_measure

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", default="1,8,16")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seats", type=int, default=16)
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args()
    return run_measure("meshd-many-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    sys.exit(main())

"""A ~4k-token prompt's time to first token: 2 stages over a LAN against one node.

    python bench/long_prompt.py                    # 1 Gbit/s 0.5 ms and 100 Mbit/s 5 ms
    python bench/long_prompt.py --tokens 2000 --rounds 1

Needs root (network namespaces, a TUN device; see bench/_delay.py). Two hosts, a and b,
each pinned to a core of its own (``taskset``: two machines), one thread a runner,
joined by the delay relay with a bandwidth limit on each direction (``DelayLan.set_rate``;
links of MTU 9000, jumbo frames, so the Python relay handles a sixth of the packets; the
run first times a TCP transfer at each rate and prints what the relay achieved).
Subjects, each a cluster of its own on the default model, all up at once and run in turn
(only one computes at a time):

* ``1 node``: a node on a, the whole model;
* ``2 stages``: nodes on a and b, layers split a -> b, chunked prefill (the default);
* ``2 stages, whole``: the same with ``$MESHD_PREFILL_CHUNK=0`` in the nodes' runners:
  each stage computes the whole prompt before it sends its rows, as before chunks.

Each request is a new ~``--tokens``-token prompt (a numbered copy of long texts, its
first line differs, ``cache_prompt: false``: no prefix reuse), greedy, 4 tokens; the
time to the first streamed token at the client on host a. Ratios are paired round by
round against the one node's TTFT in the same round, with the goals of issue 36
(<= 0.65 at 1 Gbit/s 0.5 ms, <= 0.8 at 100 Mbit/s 5 ms). A benchmark: it prints
figures and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import _delay
import lan
from _common import (
    DEFAULT_MODEL,
    READY,
    Proc,
    chat_payload,
    cpu_model,
    http_client,
    log,
    med,
    run_measure,
    stop_all,
    stream_chat,
    table,
    wait_instance_ready,
    wait_live,
)

from meshd.models.resolve import resolve_model

#: Links: (label, Mbit/s, RTT ms).
LINKS = [("1 Gbit/s, 0.5 ms", 1000.0, 0.5), ("100 Mbit/s, 5 ms", 100.0, 5.0)]
GOALS = {"1 Gbit/s, 0.5 ms": 0.65, "100 Mbit/s, 5 ms": 0.8}
TEXT = " ".join([lan.TEXT_1, lan.TEXT_2, lan.TEXT_3])


def prompts(model_path: Path, n_tokens: int, count: int) -> tuple[list[str], int]:
    """``count`` prompts of about ``n_tokens`` tokens each (long texts repeated, cut at a
    word), each with a first line of its own; and the tokens of the first."""
    from llama_cpp import Llama

    vocab = Llama(str(model_path), vocab_only=True, verbose=False)

    def size(s: str) -> int:
        return len(vocab.tokenize(s.encode(), add_bos=False))

    words = (TEXT + " ") * (1 + n_tokens * 5 // len(TEXT))
    body = words.split()
    lo, hi = 1, len(body)
    while lo < hi:  # the most words that stay within n_tokens
        mid = (lo + hi + 1) // 2
        if size(" ".join(body[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(body[:lo])
    out = [
        f"Request {i}: summarise the texts below in one sentence.\n\n{text}" for i in range(count)
    ]
    return out, size(out[0])


def ttft(client, node: lan.Node, prompt: str, n_stages: int) -> float:
    """Seconds to the first token of ``prompt`` (greedy, 4 tokens, no prefix reuse);
    RuntimeError when the node's instance is no longer on ``n_stages`` stages (a busy
    machine's missed heartbeats had it repaired onto one node: not the subject)."""
    got = client.get(f"{node.api}/v1/instances").json()["data"]
    stages = [len(i["stages"]) for i in got]
    if stages != [n_stages]:
        raise RuntimeError(f"{node.name}'s instance runs on {stages} stage(s), not {n_stages}")
    p = chat_payload(DEFAULT_MODEL, 4, meshd=True, messages=[{"role": "user", "content": prompt}])
    p["cache_prompt"] = False
    p["speculate"] = False
    return stream_chat(client, node.api, p).ttft


def start_node(
    tmp: Path, host: _delay.Host, name: str, cluster: str, peers: list[tuple[str, int]]
) -> lan.Node:
    """``meshd up`` inside ``host`` as ``lan.start_node`` starts it, waiting up to 10
    minutes for it (a busy machine imports slowly), and a silence of up to 10 minutes
    before a request's first token (its default, 30 s + 20 ms a prompt token, ends a
    prefill on a busy machine)."""
    secret = tmp / f"{cluster}.secret"
    if not secret.exists():
        from meshd.transport.security import write_secret

        write_secret(secret)
    args = lan.host_argv(host, [
        sys.executable, "-m", "meshd.cli.meshd", "up", "--name", name, "--cluster", cluster,
        "--no-model", "--no-discovery", "--api-port", "0", "--mesh-port", "0",
        "--mesh-host", host.ip, "--data-dir", str(tmp / f"data-{name}"),
        "--secret-file", str(secret), "--chunk-timeout", "600", "--request-expiry", "1200",
        *[a for ip, port in peers for a in ("--peer", f"{ip}:{port}")],
    ])  # fmt: skip
    proc = Proc(args, tmp / f"node-{name}.log", env=lan.node_env())
    _, m = proc.wait_line(READY, 600.0)
    return lan.Node(name, proc, m["api"], int(m["mesh"]))


def start_cluster(tmp: Path, hosts: list[_delay.Host], name: str, env: dict[str, str]) -> lan.Node:
    """A cluster ``name`` with a node on each of ``hosts``, the model placed a stage on
    each; its first node (the API the client asks). ``env``: set in the nodes'."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # lan.node_env() copies this process's environment
    try:
        first = start_node(tmp, hosts[0], f"{name}0", name, [])
        names = [first.name]
        for i, h in enumerate(hosts[1:], 1):
            start_node(tmp, h, f"{name}{i}", name, [(hosts[0].ip, first.mesh_port)])
            names.append(f"{name}{i}")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    client = http_client()
    try:
        wait_live(client, first, set(names), 300.0)
        # Not lan.place: on a busy machine loading takes longer than its 180 s.
        r = client.post(f"{first.api}/v1/instances", json={"model": DEFAULT_MODEL, "nodes": names})
        r.raise_for_status()
        wait_instance_ready(client, first, r.json()["id"], 900.0)
    finally:
        client.close()
    return first


def measure(tmp: Path, args: argparse.Namespace) -> int:
    ok, why = _delay.available(ping=False)
    if not ok:
        print(f"bench/long_prompt.py needs network namespaces and a TUN device: {why}")
        return 0
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("bench/long_prompt.py needs 2 CPUs (a host each)")
        return 0
    lan.PIN[0], lan.PIN[1] = str(cpus[0]), str(cpus[1])
    os.environ["MESHD_THREADS"] = "1"
    model_path = Path(resolve_model(DEFAULT_MODEL).path)
    n_runs = args.rounds * (1 + 2 * len(LINKS)) + 1
    texts, n_prompt = prompts(model_path, args.tokens, n_runs)
    log(f"prompts of {n_prompt} tokens")
    ttfts: dict[tuple[str, str], list[float]] = {}
    with _delay.DelayLan(n=2, prefix="mdlong", mtu=9000) as net:
        a, b = net.hosts
        net.set_rtt(0)
        links = []
        for label, mbit, _rtt in LINKS:  # the relay's rate, checked by a TCP transfer
            net.set_rate(mbit)
            links.append(f"{label}: a 4 MB transfer ran {net.throughput(0, 1):.0f} Mbit/s")
            log(links[-1])
        a.enter()  # the client runs on host a
        client = http_client(timeout=600.0)
        try:
            log("starting the clusters: one node on a; 2 stages a -> b, chunked and whole")
            solo = start_cluster(tmp, [a], "solo", {})
            split = start_cluster(tmp, [a, b], "chunk", {})
            whole = start_cluster(tmp, [a, b], "whole", {"MESHD_PREFILL_CHUNK": "0"})
            it = iter(texts)
            ttft(client, solo, next(it), 1)  # warm: the first request's costs are not the point
            for r in range(args.rounds):
                for label, mbit, rtt in LINKS:
                    net.set_rtt(rtt)
                    net.set_rate(mbit)
                    for key, node in (("1 node", solo), ("2 stages", split),
                                      ("2 stages, whole", whole)):  # fmt: skip
                        if key == "1 node" and label != LINKS[0][0]:
                            continue  # one node crosses no link: once a round
                        t = ttft(client, node, next(it), 1 if node is solo else 2)
                        ttfts.setdefault((key, label), []).append(t)
                        log(f"round {r}, {label}, {key}: TTFT {t:.2f} s")
        finally:
            client.close()
            stop_all()
    report(args, n_prompt, ttfts, links)
    return 0


def report(
    args: argparse.Namespace,
    n_prompt: int,
    ttfts: dict[tuple[str, str], list[float]],
    links: list[str],
) -> None:
    print(f"\n{n_prompt}-token prompt, {DEFAULT_MODEL}, greedy, time to first token at the "
          f"client; each host pinned to a core, 1 thread; {args.rounds} round(s); "
          f"{cpu_model()}")  # fmt: skip
    one = ttfts.get(("1 node", LINKS[0][0]), [])
    rows = [["1 node", "-", f"{med(one):.2f}", "1.00", "", ""]] if one else []
    for label, _, _ in LINKS:
        for key in ("2 stages", "2 stages, whole"):
            got = ttfts.get((key, label), [])
            if not got or not one:
                continue
            ratio = med([x / y for x, y in zip(got, one, strict=False)])
            goal = GOALS[label] if key == "2 stages" else None
            met = "" if goal is None else ("met" if ratio <= goal else "not met")
            rows.append([key, label, f"{med(got):.2f}", f"{ratio:.2f}",
                         f"<= {goal}" if goal else "", met])  # fmt: skip
    print(table(rows, ["subject", "link", "TTFT s", "/ 1 node", "goal", ""]))
    print("links (each way of a -> b, after the RTT's delay):", "; ".join(links))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4000, help="prompt tokens (default 4000)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every row (default 1)")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    return run_measure("meshd-long-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    sys.exit(main())

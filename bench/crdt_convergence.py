#!/usr/bin/env python
"""How fast the control plane converges, and what gossip costs, on a simulated mesh.

In-process replicas use the real :class:`meshd.crdt.LWWMap` (merge, digest, diff); only
the network is modelled:

* a write is published by its writer as a ``Delta`` to every subscriber (PUB/SUB), and
  each copy is lost with probability ``--loss`` (PUB/SUB drops to slow joiners);
* every node runs an anti-entropy timer (period ``--digest-period``, random phase).
  ``--mode broadcast`` (the default, what ``meshd.transport.gossip`` does): the node
  publishes its digest (32 bucket hashes) on PUB to every subscriber (each copy lost
  with probability ``--loss``); every receiver whose digest differs pulls from it
  (``Pull`` with its own digest, ``PullReply`` with the sender's entries in the buckets
  that differ). ``--mode fanout`` (a cheaper design, for comparison): the node sends
  its digest to ``--fanout`` random peers and pulls from them; with ``--push-pull``
  the peer also pulls from the node in the same exchange.

It prints (1) rounds and time until all replicas agree after one write, over
``--trials`` trials, for loss 0, ``--loss`` and 0.5; (2) gossip bytes per node per
second at steady state (a heartbeat every ``--heartbeat`` s per node, a digest exchange
every ``--digest-period`` s), from the real msgpack sizes of the messages.

Run: ``python bench/crdt_convergence.py`` (``--help`` for the knobs). Not a test: it
prints figures and exits 0.
"""

from __future__ import annotations

import argparse
import heapq
import random
import secrets
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec

from meshd.crdt import HLC, N_BUCKETS, Entry, LWWMap
from meshd.crdt.views import (
    Instance,
    InstanceSpec,
    NodeCard,
    Stage,
    encode,
    health_key,
    instance_key,
    node_key,
)

# -- wire envelopes --------------------------------------------------------------------
# The real wire types, so the byte figures follow the transport. PUB/SUB messages carry
# an extra 8-byte topic frame (the cluster hash).
from meshd.transport.wire import Delta, Digest, Pull, PullReply

TOPIC_BYTES = 8


_enc = msgspec.msgpack.Encoder()


def size(msg: msgspec.Struct | list[int]) -> int:
    """Encoded size in bytes."""
    return len(_enc.encode(msg))


# -- the simulated cluster -------------------------------------------------------------

T0_MS = 1_700_000_000_000
#: A clock value of realistic magnitude (packs as a full uint64), for message fields.
REAL_HLC = T0_MS << 16


class SimWall:
    """Simulated wall clock (ms) shared by every node's HLC."""

    def __init__(self) -> None:
        self.ms = T0_MS

    def __call__(self) -> int:
        return self.ms


def node_card(nid: str, i: int) -> NodeCard:
    return NodeCard(
        id=nid,
        name=f"host-{i:02d}.local",
        incarnation=secrets.token_hex(8),
        cluster="home",
        version="0.1.0",
        os="darwin" if i % 2 else "linux",
        arch="arm64" if i % 2 else "x86_64",
        cpu_count=10,
        mem_total=64 << 30,
        mem_available=40 << 30,
        backends=["mlx-metal", "llama_cpp-cpu"] if i % 2 else ["llama_cpp-cpu"],
        addresses=[f"192.168.1.{10 + i}", f"fe80::1c2b:3aff:fe4d:{i:04x}"],
        mesh_port=47470,
        pub_port=47471,
        api_port=8000,
        models=["qwen2.5-7b-instruct-q4_k_m", "llama-3.1-8b-instruct"],
        started_ms=T0_MS,
    )


@dataclass
class Cluster:
    ids: list[str]
    base: LWWMap
    wall: SimWall
    clocks: list[HLC]
    rng: random.Random
    health_bytes: int
    card_entry_bytes: int = 0

    def health_entry(self, i: int) -> Entry:
        hlc = self.clocks[i].now()
        return Entry(
            health_key(self.ids[i]), hlc, self.ids[i], self.rng.randbytes(self.health_bytes)
        )


def build_cluster(n: int, health_bytes: int, n_instances: int, rng: random.Random) -> Cluster:
    """A settled cluster: every node's card and heartbeat, plus a few placed models."""
    ids = [rng.randbytes(8).hex() for _ in range(n)]
    wall = SimWall()
    clocks = [HLC(wall=wall) for _ in ids]
    c = Cluster(ids, LWWMap(), wall, clocks, rng, health_bytes)
    for i, nid in enumerate(ids):
        e = c.base.put(node_key(nid), encode(node_card(nid, i)), clocks[i].now(), nid)
        c.card_entry_bytes = size(e)
        c.base.merge(c.health_entry(i))
    for k in range(n_instances):
        a, b = rng.sample(ids, 2)
        inst = Instance(
            id=f"inst-{k}",
            spec=InstanceSpec(model="llama-3.1-70b-instruct-q4_k_m", min_nodes=2),
            stages=[
                Stage(node=a, start=0, end=40, engine="llama_cpp-cpu"),
                Stage(node=b, start=40, end=80, engine="llama_cpp-cpu"),
            ],
        )
        c.base.put(instance_key(inst.id), encode(inst), clocks[0].now(), ids[0])
    return c


@dataclass
class Knobs:
    mode: str
    fanout: int
    loss: float
    heartbeat: float
    period: float
    latency: float
    push_pull: bool


@dataclass
class Traffic:
    """Bytes per node, by kind, in each direction."""

    out: dict[str, list[int]] = field(default_factory=dict)
    inn: dict[str, list[int]] = field(default_factory=dict)

    def add(self, kind: str, src: int, dst: int, nbytes: int, n: int) -> None:
        self.out.setdefault(kind, [0] * n)[src] += nbytes
        self.inn.setdefault(kind, [0] * n)[dst] += nbytes


def exchange(
    maps: list[LWWMap], ids: list[str], i: int, k: int, traffic: Traffic | None
) -> list[Entry]:
    """Node ``i`` pulls from ``k`` (a ``Pull`` carrying ``i``'s digest); ``k`` answers
    with its entries in the buckets that differ."""
    dig = maps[i].digest()
    got = maps[k].diff(dig)
    changed = maps[i].merge_many(got)
    if traffic is not None:
        n = len(maps)
        traffic.add("pull", i, k, size(Pull(sender=ids[i], buckets=list(dig))), n)
        reply = PullReply(sender=ids[k], hlc=REAL_HLC, entries=got)
        traffic.add("pull reply", k, i, size(reply), n)
    return changed


def anti_entropy(
    maps: list[LWWMap],
    ids: list[str],
    i: int,
    knobs: Knobs,
    rng: random.Random,
    traffic: Traffic | None = None,
) -> Counter[str]:
    """One firing of node ``i``'s anti-entropy timer."""
    if knobs.mode == "broadcast":
        return broadcast_digest(maps, ids, i, knobs, rng, traffic)
    stats: Counter[str] = Counter()
    peers = rng.sample(range(len(maps) - 1), knobs.fanout)
    for p in peers:
        k = p if p < i else p + 1  # every index but i
        stats["exchanges"] += 1
        if maps[i].digest() != maps[k].digest():
            stats["exchanges that differ"] += 1
        stats["entries merged"] += len(exchange(maps, ids, i, k, traffic))
        if knobs.push_pull:
            stats["entries merged"] += len(exchange(maps, ids, k, i, traffic))
    return stats


def broadcast_digest(
    maps: list[LWWMap],
    ids: list[str],
    i: int,
    knobs: Knobs,
    rng: random.Random,
    traffic: Traffic | None = None,
) -> Counter[str]:
    """Node ``i`` publishes its digest; every receiver that differs pulls from ``i``."""
    stats: Counter[str] = Counter()
    dig = maps[i].digest()
    n = len(maps)
    digest_bytes = TOPIC_BYTES + size(Digest(sender=ids[i], hlc=REAL_HLC, buckets=list(dig)))
    for j in range(n):
        if j == i or rng.random() < knobs.loss:
            continue
        stats["exchanges"] += 1
        if traffic is not None:
            traffic.add("digest", i, j, digest_bytes, n)
        if maps[j].digest() == dig:
            continue
        stats["exchanges that differ"] += 1
        stats["entries merged"] += len(exchange(maps, ids, j, i, traffic))
    return stats


# -- (1) convergence after one write ------------------------------------------------------


@dataclass
class Trial:
    rounds: int
    seconds: float
    cpu_s: float


def convergence_trial(c: Cluster, knobs: Knobs, rng: random.Random, seq: int) -> Trial:
    start = time.perf_counter()
    n = len(c.ids)
    maps = [c.base.copy() for _ in range(n)]
    w = rng.randrange(n)
    c.wall.ms += 1000
    e = Entry(instance_key(f"new-{seq}"), c.clocks[w].now(), c.ids[w], rng.randbytes(200))
    maps[w].merge(e)
    got_at = {w: 0.0}
    for j in range(n):
        if j != w and rng.random() >= knobs.loss:
            maps[j].merge(e)
            got_at[j] = knobs.latency
    if len(got_at) == n:
        return Trial(0, knobs.latency, time.perf_counter() - start)
    # Anti-entropy timers, each with its own phase.
    timers = [(rng.uniform(0, knobs.period), i) for i in range(n)]
    heapq.heapify(timers)
    while True:
        t, i = heapq.heappop(timers)
        anti_entropy(maps, c.ids, i, knobs, rng)
        done = t + 2 * knobs.latency  # a request and its reply
        for j in range(n):
            if j not in got_at and maps[j].get(e.key) == e:
                got_at[j] = done
        if len(got_at) == n:
            break
        if t > 1000 * knobs.period:
            raise RuntimeError("no convergence")
        heapq.heappush(timers, (t + knobs.period, i))
    cpu = time.perf_counter() - start
    ref = maps[w].digest()
    assert all(m.digest() == ref and m.same_state(maps[w]) for m in maps)
    return Trial(int(t // knobs.period) + 1, max(got_at.values()), cpu)


# -- (2) steady-state gossip bytes ---------------------------------------------------------


def steady_state(
    c: Cluster, knobs: Knobs, rng: random.Random, duration: float, warmup: float
) -> tuple[Traffic, Counter[str], float]:
    n = len(c.ids)
    maps = [c.base.copy() for _ in range(n)]
    traffic = Traffic()
    stats: Counter[str] = Counter()
    t0 = c.wall.ms / 1000
    events = [(rng.uniform(0, knobs.heartbeat), 0, i) for i in range(n)]
    events += [(rng.uniform(0, knobs.period), 1, i) for i in range(n)]
    heapq.heapify(events)
    start = time.perf_counter()
    while events[0][0] < warmup + duration:
        t, kind, i = heapq.heappop(events)
        c.wall.ms = int((t0 + t) * 1000)
        counted = traffic if t >= warmup else Traffic()
        if kind == 0:  # heartbeat: a Delta on PUB to every subscriber
            e = c.health_entry(i)
            maps[i].merge(e)
            nbytes = TOPIC_BYTES + size(Delta(sender=c.ids[i], entries=[e]))
            for j in range(n):
                if j != i and rng.random() >= knobs.loss:
                    maps[j].merge(e)
                    counted.add("delta", i, j, nbytes, n)
            heapq.heappush(events, (t + knobs.heartbeat, 0, i))
        else:
            s = anti_entropy(maps, c.ids, i, knobs, rng, counted)
            if t >= warmup:
                stats.update(s)
            heapq.heappush(events, (t + knobs.period, 1, i))
    return traffic, stats, time.perf_counter() - start


# -- report -------------------------------------------------------------------------------


def kib(x: float) -> str:
    return f"{x / 1024:8.1f} KiB/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=64, help="nodes in the mesh (64)")
    ap.add_argument(
        "--mode",
        choices=("broadcast", "fanout"),
        default="broadcast",
        help="broadcast: digest on PUB to all, receivers that differ pull (what meshd does);"
        " fanout: pull from --fanout random peers (default broadcast)",
    )
    ap.add_argument("--fanout", type=int, default=3, help="peers per round in fanout mode (3)")
    ap.add_argument("--loss", type=float, default=0.10, help="delta loss rate (0.10)")
    ap.add_argument("--trials", type=int, default=50, help="trials per loss rate (50)")
    ap.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat period, s (0.5)")
    ap.add_argument("--digest-period", type=float, default=1.0, help="digest period, s (1.0)")
    ap.add_argument("--latency", type=float, default=0.001, help="one-way latency, s (0.001)")
    ap.add_argument("--health-bytes", type=int, default=120, help="heartbeat value size (120)")
    ap.add_argument("--instances", type=int, default=8, help="placed models in the state (8)")
    ap.add_argument("--duration", type=float, default=30.0, help="steady-state window, s (30)")
    ap.add_argument("--push-pull", action="store_true", help="the peer pulls back too")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if not 1 <= args.fanout < args.replicas:
        ap.error("--fanout must be between 1 and replicas - 1")
    if not 0.0 <= args.loss < 1.0:
        ap.error("--loss must be in [0, 1)")

    rng = random.Random(args.seed)
    c = build_cluster(args.replicas, args.health_bytes, args.instances, rng)
    hb = c.health_entry(0)
    digest_bytes = size(list(c.base.digest()))
    delta_bytes = TOPIC_BYTES + size(Delta(sender=c.ids[0], entries=[hb]))
    print("meshd CRDT gossip benchmark (real LWWMap merge/digest/diff, simulated network)")
    print(
        f"  replicas={args.replicas} mode={args.mode}"
        f"{f' fanout={args.fanout}' if args.mode == 'fanout' else ''} loss={args.loss:.0%} "
        f"trials={args.trials} heartbeat={args.heartbeat}s digest-period={args.digest_period}s "
        f"latency={args.latency * 1000:g}ms{' push-pull' if args.push_pull else ''} "
        f"seed={args.seed}"
    )
    print(
        f"  state: {len(c.base)} entries ({args.replicas} cards, {args.replicas} heartbeats, "
        f"{args.instances} instances) in {N_BUCKETS} buckets"
    )
    print("encoded sizes (msgpack):")
    pull_bytes = size(Pull(sender=c.ids[0], buckets=list(c.base.digest())))
    for label, nbytes in (
        (f"health Entry ({args.health_bytes} B value)", size(hb)),
        ("node-card Entry", c.card_entry_bytes),
        ("Delta(1 heartbeat) + topic frame", delta_bytes),
        (f"digest ({N_BUCKETS} x uint64)", digest_bytes),
        ("Pull (digest request)", pull_bytes),
    ):
        print(f"  {label:<34} {nbytes:5d} B")
    print()
    print("(1) convergence after one write: delta to all subscribers, then anti-entropy")
    print("    rounds = digest periods until every replica holds the write (0 = delta alone)")
    print(
        f"    {'loss':>5}  {'rounds med':>10} {'max':>4}  {'time med':>9} {'max':>8}  "
        f"{'cpu/trial':>9}  goal (<= 3 rounds, <= 1 s)"
    )
    knobs = Knobs(
        args.mode,
        args.fanout,
        args.loss,
        args.heartbeat,
        args.digest_period,
        args.latency,
        args.push_pull,
    )
    for loss in sorted({0.0, args.loss, 0.5}):
        k = Knobs(**{**knobs.__dict__, "loss": loss})
        trials = [convergence_trial(c, k, rng, s) for s in range(args.trials)]
        rounds = [t.rounds for t in trials]
        secs = [t.seconds for t in trials]
        ok_med = statistics.median(rounds) <= 3 and statistics.median(secs) <= 1.0
        ok_max = max(rounds) <= 3 and max(secs) <= 1.0
        verdict = "met" if ok_max else ("met at median, not at max" if ok_med else "NOT met")
        print(
            f"    {loss:5.0%}  {statistics.median(rounds):10g} {max(rounds):4d}  "
            f"{statistics.median(secs):8.3f}s {max(secs):7.3f}s  "
            f"{statistics.median(t.cpu_s for t in trials) * 1000:7.1f}ms  {verdict}"
        )

    print()
    print(
        f"(2) steady state: heartbeat every {args.heartbeat}s per node, a digest every "
        f"{args.digest_period}s "
        f"({'to every peer' if args.mode == 'broadcast' else f'to {args.fanout} peers'});"
        " bytes per node per second"
    )
    print("    (msgpack payload + PUB topic frame; ZMTP/TCP/IP headers not counted)")
    for loss in sorted({0.0, args.loss}):
        k = Knobs(**{**knobs.__dict__, "loss": loss})
        traffic, stats, cpu = steady_state(c, k, rng, args.duration, warmup=2.0)
        n = args.replicas
        print(f"    loss {loss:.0%} (simulated {args.duration:g}s in {cpu:.1f}s cpu):")
        tot_out, tot_in = [0] * n, [0] * n
        for kind in ("delta", "digest", "pull", "pull reply"):
            out = traffic.out.get(kind, [0] * n)
            inn = traffic.inn.get(kind, [0] * n)
            tot_out = [a + b for a, b in zip(tot_out, out, strict=True)]
            tot_in = [a + b for a, b in zip(tot_in, inn, strict=True)]
            print(
                f"      {kind:<11} out {kib(statistics.mean(out) / args.duration)}"
                f"   in {kib(statistics.mean(inn) / args.duration)}"
            )
        print(
            f"      {'total':<11} out {kib(statistics.mean(tot_out) / args.duration)}"
            f"   in {kib(statistics.mean(tot_in) / args.duration)}"
            f"   (busiest node: out {kib(max(tot_out) / args.duration).strip()},"
            f" in {kib(max(tot_in) / args.duration).strip()})"
        )
        ex = stats["exchanges"]
        differ = stats["exchanges that differ"]
        print(
            f"      digest exchanges that found a difference: {differ}/{ex}"
            f" ({(differ / ex if ex else 0):.0%}); entries merged by anti-entropy:"
            f" {stats['entries merged'] / args.duration / n:.2f} per node per s"
        )
        expect = delta_bytes * (n - 1) * (1 - loss) / args.heartbeat
        print(
            f"      check: delta out expected {kib(expect).strip()} = {delta_bytes} B x "
            f"{n - 1} subscribers x {1 - loss:.2f} / {args.heartbeat}s"
        )


if __name__ == "__main__":
    main()

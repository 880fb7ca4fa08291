"""What per-node keys cost the control plane: signing, verifying, and merging gossip.

    python bench/keys.py                  # 2000 heartbeats, a 1000-entry welcome, 5 repeats
    python bench/keys.py --entries 5000 --repeats 9

In one process, on the real ``meshd.crdt.Replica`` and the real trust rules
(``meshd.node.trust.ClusterTrust``): a replica of a secured cluster (every write signed,
every remote entry's signature and writer checked) against one of an open cluster (no
keys), on the same entries. Prints the time per heartbeat written and merged, the time
to merge a welcome (a new node taking the whole state), the bytes an entry grows by,
and each ratio secured / open measured in the same run. A benchmark: it prints figures
and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time

import msgspec

from meshd.crdt.hlc import HLC
from meshd.crdt.replica import Replica
from meshd.crdt.views import Health, Member, NodeCard, health_key, member_key, node_key
from meshd.node.trust import ClusterTrust
from meshd.transport.identity import NodeKey, member_proof, sign_entry

CLUSTER_KEY = secrets.token_bytes(32)


def card(nid: str) -> NodeCard:
    return NodeCard(
        id=nid, name=nid[:6], incarnation="i", cluster="c", version="0.1.0", os="linux",
        arch="x86_64", cpu_count=8, mem_total=32 << 30, mem_available=24 << 30,
        backends=["llama_cpp-cpu"], addresses=["192.168.1.20"], mesh_port=7471,
        pub_port=40000, api_port=7470, data_port=40001, models=["smollm2-135m"],
    )  # fmt: skip


def writers(n: int, secured: bool) -> list[Replica]:
    out = []
    for _ in range(n):
        key = NodeKey.generate()
        kw = {"signer": lambda e, k=key: sign_entry(k, e)} if secured else {}
        r = Replica(key.node_id, HLC(), **kw)
        if secured:
            m = Member(id=key.node_id, name="n", key=key.public, by=key.node_id,
                       proof=member_proof(CLUSTER_KEY, key.public))  # fmt: skip
            r.write(member_key(key.node_id), m)
        r.write(node_key(key.node_id), card(key.node_id))
        out.append(r)
    return out


def reader(secured: bool, members: list[Replica]) -> Replica:
    key = NodeKey.generate()
    if not secured:
        return Replica(key.node_id, HLC())
    r = Replica(key.node_id, HLC(), signer=lambda e: sign_entry(key, e),
                trust=ClusterTrust(CLUSTER_KEY))  # fmt: skip
    r.install(e for w in members for e in w.map.entries() if e.key.startswith("member/"))
    return r


def run(secured: bool, n_writers: int, beats: int, entries: int) -> dict[str, float]:
    ws = writers(n_writers, secured)
    # Heartbeats: written (signed) by the writers, merged by a reader.
    t0 = time.perf_counter()
    hb = [ws[i % n_writers].write(health_key(ws[i % n_writers].node_id), Health(seq=i))
          for i in range(beats)]  # fmt: skip
    t_write = (time.perf_counter() - t0) / beats
    r = reader(secured, ws)
    r.merge_remote([e for w in ws for e in w.map.entries()])
    t0 = time.perf_counter()
    for e in hb:
        r.merge_remote([e])
    t_merge = (time.perf_counter() - t0) / beats
    # A welcome: the whole state of a cluster at once (cards, heartbeats, and entries
    # under instance/ spread over the writers: one writer may hold 256 at most).
    for i in range(entries):
        ws[i % n_writers].write(f"instance/i{i}", Health(seq=i))
    state = [e for w in ws for e in w.map.entries()]
    fresh = reader(secured, ws)
    t0 = time.perf_counter()
    res = fresh.merge_remote(state)
    t_welcome = time.perf_counter() - t0
    assert not res.refused, res.refused
    size = sum(len(msgspec.msgpack.encode(e)) for e in state) / len(state)
    return {"write": t_write, "merge": t_merge, "welcome": t_welcome, "size": size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--beats", type=int, default=2000)
    p.add_argument("--entries", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    ratios: dict[str, list[float]] = {k: [] for k in ("write", "merge", "welcome")}
    last: dict[bool, dict[str, float]] = {}
    for _ in range(a.repeats):
        for secured in (False, True):
            last[secured] = run(secured, a.writers, a.beats, a.entries)
        for k in ratios:
            ratios[k].append(last[True][k] / last[False][k])
    print(f"{a.writers} writers, {a.beats} heartbeats, a welcome of ~{a.entries} entries, "
          f"{a.repeats} repeats (median ratio secured / open, same run)")  # fmt: skip
    print(f"{'':28} {'open':>12} {'secured':>12} {'ratio':>8}")
    for k, label, unit, scale in (("write", "heartbeat written", "us", 1e6),
                                  ("merge", "heartbeat merged", "us", 1e6),
                                  ("welcome", "welcome merged", "ms", 1e3)):  # fmt: skip
        print(f"{label:28} {last[False][k] * scale:10.1f}{unit} {last[True][k] * scale:10.1f}"
              f"{unit} {statistics.median(ratios[k]):8.2f}")  # fmt: skip
    print(
        f"{'entry on the wire (bytes)':28} {last[False]['size']:12.0f} "
        f"{last[True]['size']:12.0f} {last[True]['size'] / last[False]['size']:8.2f}"
    )


if __name__ == "__main__":
    main()

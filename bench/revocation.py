"""What removing a member costs an N-node cluster: how soon every node knows, and how
soon the removed key hears nothing more on any of them.

    python bench/revocation.py              # 8 nodes on loopback, 3 removals
    python bench/revocation.py --nodes 4 --repeats 1

Real ``meshd up`` processes on loopback (one secret file: every node a member at once,
as a household's are after approval). Each repeat removes one node through the first
node's API (``DELETE /v1/members/NAME``) while a raw SUB holding the removed node's own
key (read from its data dir, as a script on that machine could) listens on every other
node's PUB. Prints, per repeat, when the last node's member list lost it (propagation:
the baseline, gossip as it always is) and when the last PUB stopped sending to its key
(enforcement: a PUB re-bound on every node), and the ratio of the two in the same run.
A benchmark: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import zmq
from _common import Node, http_client, start_node, stop_all, wait_live

from meshd.transport import wire
from meshd.transport.identity import NodeKey, curve_public_of
from meshd.transport.security import CurveKeys, read_private, secure


def _server_key(ctx: zmq.Context, n: Node) -> bytes:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVTIMEO, 5000)
    d.connect(f"tcp://127.0.0.1:{n.mesh_port + 1}")
    d.send(wire.encode(wire.JoinWho()))
    ident = wire.decode_join(d.recv())
    d.close()
    assert isinstance(ident, wire.JoinIdent)
    return curve_public_of(ident.key)


def _pub_port(client, n: Node) -> int:
    return int(client.get(f"{n.api}/healthz").json()["pub_port"])


def one_removal(client, ctx: zmq.Context, tmp: Path, nodes: list[Node], victim: Node):
    """(propagation s, enforcement s) of removing ``victim`` through ``nodes[0]``."""
    keys = CurveKeys(*NodeKey(read_private(tmp / f"data-{victim.name}" / "node.key")).curve_pair())
    rest = [n for n in nodes if n is not victim]
    subs = []
    for n in rest:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        secure(s, keys, server=False, server_key=_server_key(ctx, n))
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://127.0.0.1:{_pub_port(client, n)}")
        subs.append(s)
    for s in subs:
        assert s.poll(10_000), "the victim's key hears nothing before its removal"
    t0 = time.monotonic()
    r = client.delete(f"{nodes[0].api}/v1/members/{victim.name}")
    r.raise_for_status()
    known: dict[str, float] = {}
    last = {id(s): t0 for s in subs}
    poller = zmq.Poller()
    for s in subs:
        poller.register(s, zmq.POLLIN)
    while time.monotonic() - max(last.values()) < 2.0 or len(known) < len(rest):
        for s, _ in poller.poll(50):
            s.recv_multipart()
            last[id(s)] = time.monotonic()
        for n in rest:
            if n.name not in known:
                names = {m["name"] for m in client.get(f"{n.api}/v1/members").json()["data"]}
                if victim.name not in names:
                    known[n.name] = time.monotonic()
        if time.monotonic() - t0 > 60:
            raise TimeoutError("the removal did not take in 60 s")
    for s in subs:
        s.close(0)
    return max(known.values()) - t0, max(last.values()) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8, help="nodes in the cluster (8)")
    ap.add_argument("--repeats", type=int, default=3, help="removals, one node each (3)")
    args = ap.parse_args()
    ctx = zmq.Context()
    client = http_client(30.0)
    with tempfile.TemporaryDirectory(prefix="meshd-revocation-") as d:
        tmp = Path(d)
        try:
            nodes = [start_node(tmp, "n0", "rev")]
            nodes += [
                start_node(tmp, f"n{i}", "rev", peers=nodes[:1]) for i in range(1, args.nodes)
            ]
            wait_live(client, nodes[0], {n.name for n in nodes}, 60)
            rows = []
            for i in range(min(args.repeats, args.nodes - 2)):
                victim = nodes[-1]
                prop, cut = one_removal(client, ctx, tmp, nodes, victim)
                rows.append((len(nodes), prop, cut))
                nodes.pop()
                print(f"removal {i + 1}: {len(nodes) + 1} nodes, every node knew in "
                      f"{prop:.2f} s, its key cut off everywhere in {cut:.2f} s")  # fmt: skip
        finally:
            stop_all()
            ctx.destroy(linger=0)
    ratios = [cut / prop for _, prop, cut in rows if prop > 0]
    print(f"\nremoval in a cluster of {args.nodes}: propagation median "
          f"{statistics.median(r[1] for r in rows):.2f} s, enforcement median "
          f"{statistics.median(r[2] for r in rows):.2f} s, enforcement / propagation "
          f"{statistics.median(ratios):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()

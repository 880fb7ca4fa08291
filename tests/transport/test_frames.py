"""Garbage and oversized frames on every socket of a real node are dropped and counted.

The nodes run ``--open``: these frames are written by hand by a test that holds no key,
and a secured node refuses such a peer at the CURVE handshake before any decoder runs
(tests/node/test_intruders.py); the join desk, the one plain socket of a secured node,
is tested here too.
"""

from __future__ import annotations

import time

import pytest
import spake2
import zmq

from meshd.crdt.hlc import HLC
from meshd.crdt.lww import Entry
from meshd.crdt.views import NodeCard, encode, node_key
from meshd.node.joining import APPROVAL_IDS, approval_tag, new_approval_code, normal_code
from meshd.transport import wire
from meshd.transport.identity import NodeKey
from meshd.transport.security import PROTOCOL
from tests.cluster import Cluster, NodeProc, wait_for

pytestmark = pytest.mark.timeout(60)


def _dropped(n: NodeProc, sock: str, reason: str) -> int:
    return n.get("/healthz")["dropped"].get(sock, {}).get(reason, 0)


def _request(ctx: zmq.Context, n: NodeProc, frames: list[bytes]) -> list[bytes] | None:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{n.mesh_port}")
    try:
        d.send_multipart(frames)
        if d.poll(2000):
            return d.recv_multipart()
        return None
    finally:
        d.close()


def test_garbage_and_oversized_frames_on_the_mesh_router_are_dropped_and_counted(
    cluster: Cluster,
) -> None:
    n = cluster.start("a", extra_args=["--open"])
    ctx = zmq.Context()
    try:
        assert _request(ctx, n, [b"\xc1\xff not msgpack"]) is None
        assert _request(ctx, n, [b"\x00" * (wire.MAX_CONTROL_FRAME + 1)]) is None
        # Valid msgpack, wrong type for a request: refused with a typed reply.
        reply = _request(ctx, n, [wire.encode(wire.Delta(sender="x", entries=[]))])
        assert reply is not None
        refused = wire.decode_gossip(reply[0])
        assert isinstance(refused, wire.Refused) and refused.code == "unexpected"
        # A digest of the wrong size is refused, not a crash.
        reply = _request(ctx, n, [wire.encode(wire.Pull(sender="x", buckets=[1, 2]))])
        assert reply is not None and wire.decode_gossip(reply[0]).code == "bad_digest"

        wait_for(lambda: _dropped(n, "mesh", "malformed") >= 2, timeout=2)
        assert _dropped(n, "mesh", "oversized") == 1
        assert _dropped(n, "mesh", "unexpected") == 1
        # Still serving: a proper pull gets a proper reply.
        reply = _request(ctx, n, [wire.encode(wire.Pull(sender="x", buckets=[0] * 32))])
        assert reply is not None and isinstance(wire.decode_gossip(reply[0]), wire.PullReply)
        assert n.alive()
    finally:
        ctx.destroy(linger=0)


def test_garbage_and_oversized_gossip_from_a_peer_is_dropped_and_counted(
    cluster: Cluster,
) -> None:
    n = cluster.start("a", extra_args=["--open"])
    topic = wire.cluster_hash(cluster.cluster_name)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        # Pose as a peer: say hello with a card pointing at our PUB socket.
        clock = HLC()
        card = NodeCard(
            id="feedfacefeedface", name="fake", incarnation="1", cluster=cluster.cluster_name,
            version="0", os="linux", arch="x86_64", cpu_count=1, mem_total=1, mem_available=1,
            addresses=["127.0.0.1"], mesh_port=1, pub_port=pub_port, api_port=1,
        )  # fmt: skip
        entry = Entry(node_key(card.id), clock.now(), card.id, encode(card))
        hello = wire.Hello(sender=card.id, cluster=topic, incarnation="1", entries=[entry])
        reply = _request(ctx, n, [wire.encode(hello)])
        assert reply is not None and isinstance(wire.decode_gossip(reply[0]), wire.Welcome)

        def sent_and_counted() -> bool:
            pub.send_multipart([topic, b"\xc1 garbage"])
            pub.send_multipart([topic, b"\x00" * (wire.MAX_CONTROL_FRAME + 1)])
            pub.send_multipart([topic, b"a", b"three frames"])
            time.sleep(0.1)
            return (
                _dropped(n, "gossip", "malformed") >= 1
                and _dropped(n, "gossip", "oversized") >= 1
                and _dropped(n, "gossip", "shape") >= 1
            )

        wait_for(sent_and_counted, timeout=5)
        assert n.alive()
        assert n.get("/healthz")["status"] == "ok"
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_forged_entries_for_another_nodes_keys_are_refused(cluster: Cluster) -> None:
    a = cluster.start("a", extra_args=["--open"])
    ctx = zmq.Context()
    try:
        clock = HLC()
        forged = Entry(node_key(a.node_id), clock.now() + (1 << 20), "intruder", b"\x80")
        hello = wire.Hello(
            sender="intruder", cluster=wire.cluster_hash(cluster.cluster_name),
            incarnation="1", entries=[forged],
        )  # fmt: skip
        _request(ctx, a, [wire.encode(hello)])
        wait_for(lambda: _dropped(a, "entries", "foreign_owner") == 1, timeout=2)
        assert a.cluster()["nodes"][0]["name"] == "a"
    finally:
        ctx.destroy(linger=0)


def test_garbage_on_the_join_desk_of_a_secured_node_is_dropped_and_counted(
    cluster: Cluster,
) -> None:
    n = cluster.start("a")
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{n.mesh_port + 1}")
        d.send(b"\xc1\xff not msgpack")
        d.send(b"\x00" * (wire.MAX_JOIN_FRAME + 10))  # libzmq cuts the peer: not answered
        d.send_multipart([b"two", b"frames"])
        time.sleep(1.0)
        assert not d.poll(500)
        d.close()
        # Still answering: a proper request gets a proper answer.
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{n.mesh_port + 1}")
        key = NodeKey.generate().public
        spake = spake2.SPAKE2_A(normal_code(new_approval_code()).encode(), **APPROVAL_IDS)
        hello = wire.JoinHello(name="x", key=key, spake=spake.start(), protocol=PROTOCOL,
                               tag=approval_tag(new_approval_code(), key))  # fmt: skip
        d.send(wire.encode(hello))
        assert d.poll(3000)
        assert isinstance(wire.decode_join(d.recv()), wire.JoinPending)
        d.close()
        assert n.alive()
    finally:
        ctx.destroy(linger=0)

"""Removing a member, for real: its live connections end on every node, it stays out
across its restarts, and the cluster key it kept mints nothing.

Three nodes on loopback started as a user would (no secret file: a first node, two
paired in with codes); the removed node's own key, read from its data dir, is what the
attacker's raw sockets use.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from meshd.transport import wire
from meshd.transport.identity import NodeKey, curve_public_of, member_proof
from meshd.transport.security import PROTOCOL, CurveKeys, read_private, secure
from tests.cluster import Cluster, NodeProc, wait_for

from .hand import HandMember

pytestmark = pytest.mark.timeout(240)


def _join_with_code(c: Cluster, a: NodeProc, name: str) -> NodeProc:
    code = httpx.post(a.api + "/v1/invites", json={}, timeout=10).json()["code"]
    return c.start(name, peers=[a], secret=False, extra_args=["--join", code], wait=False)


def _denied(n: NodeProc) -> int:
    return n.get("/healthz")["dropped"].get("zap", {}).get("zap_denied", 0)


def _members(n: NodeProc) -> set[str]:
    return {m["name"] for m in n.get("/v1/members")["data"]}


def _key_of(n: NodeProc) -> NodeKey:
    return NodeKey(read_private(n.data_dir / "node.key"))


def _server_key(ctx: zmq.Context, n: NodeProc) -> bytes:
    ident = HandMember.ask(ctx, n, wire.JoinWho())
    assert isinstance(ident, wire.JoinIdent)
    return curve_public_of(ident.key)


def _sub(ctx: zmq.Context, keys: CurveKeys, server_key: bytes, port: int) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    secure(s, keys, server=False, server_key=server_key)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _last_messages(subs: list[zmq.Socket], quiet_s: float, bound_s: float) -> list[float]:
    """Read every socket at once until ``quiet_s`` passes with nothing on any; when the
    last message came on each."""
    poller = zmq.Poller()
    for s in subs:
        poller.register(s, zmq.POLLIN)
    last = [time.monotonic()] * len(subs)
    deadline = last[0] + bound_s
    while time.monotonic() - max(last) < quiet_s:
        if time.monotonic() > deadline:
            raise AssertionError(f"still receiving after {bound_s} s")
        for s, _ in poller.poll(50):
            s.recv_multipart()
            last[subs.index(s)] = time.monotonic()
    return last


def _hello(ctx: zmq.Context, keys: CurveKeys, server_key: bytes, n: NodeProc, me: str) -> bool:
    """Whether ``n``'s mesh port answers a hello sent with ``keys`` (bounded: a DEALER
    whose handshake ZAP refused has no peer to send to)."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.SNDTIMEO, 3000)
    secure(d, keys, server=False, server_key=server_key)
    d.connect(f"tcp://127.0.0.1:{n.mesh_port}")
    cluster = wire.cluster_hash(n.get("/healthz")["cluster"])
    try:
        d.send(wire.encode(wire.Hello(sender=me, cluster=cluster, incarnation="x")))
        return bool(d.poll(3000))
    except zmq.Again:
        return False
    finally:
        d.close(0)


def test_a_removed_member_is_cut_off_at_once_and_stays_out(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    a = cluster.start("a", secret=False)
    b, c = _join_with_code(cluster, a, "b"), _join_with_code(cluster, a, "c")
    cluster.wait_ready(b)
    cluster.wait_ready(c)
    for n in (a, b, c):
        wait_for(lambda n=n: n.liveness() == {"a": "alive", "b": "alive", "c": "alive"}, 30)
    assert [m["name"] for m in a.get("/v1/members")["data"] if m.get("owner")] == ["a"]
    ctx = zmq.Context()
    try:
        # b's own key, as a script on b's machine holds it: heard on a's and c's PUBs,
        # answered on a's mesh port.
        bk = _key_of(b)
        b_keys = CurveKeys(*bk.curve_pair())
        subs = [_sub(ctx, b_keys, _server_key(ctx, n), n.pub_port) for n in (a, c)]
        for s in subs:
            assert s.poll(5000), "b's key hears nothing before its removal: proves nothing"
        assert _hello(ctx, b_keys, _server_key(ctx, a), a, bk.node_id)

        # Only an owner removes: c is a member, not an owner.
        r = httpx.delete(c.api + f"/v1/members/{b.node_id}", timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "not_owner", r.text
        assert _members(a) == {"a", "b", "c"}

        t0 = time.monotonic()
        r = httpx.delete(a.api + "/v1/members/b", timeout=10)
        assert r.status_code == 200, r.text
        cut = [t - t0 for t in _last_messages(subs, quiet_s=1.0, bound_s=10)]
        assert max(cut) < 2.0, cut
        assert not _hello(ctx, b_keys, _server_key(ctx, a), a, bk.node_id)
        wait_for(lambda: _members(c) == {"a", "c"}, 10)
        with capsys.disabled():
            print(f"\nremoval -> b's key cut off: a's PUB {cut[0]:.2f} s, c's {cut[1]:.2f} s")
        for s in subs:
            s.close(0)

        # Restarted with no flags (its data dir still says it is a member): it stays out.
        b.kill()
        denied = _denied(a)
        b2 = cluster.start("b", data_dir=b.data_dir, peers=[a], secret=False)
        wait_for(lambda: _denied(a) > denied, 15)  # it tried, and ZAP turned it away
        for n in (a, c):
            assert n.liveness() == {"a": "alive", "c": "alive"}, n.liveness()
            assert _members(n) == {"a", "c"}
        assert b2.liveness().get("a") != "alive"

        # The cluster key b kept mints nothing: a new identity vouched for with it is
        # refused at the desk (only a secret-file cluster takes such a proof).
        kept = read_private(b.data_dir / "cluster.key")
        eve = NodeKey.generate()
        hello = wire.JoinHello(name="alpha", key=eve.public, protocol=PROTOCOL,
                               proof=member_proof(kept, eve.public))  # fmt: skip
        got = HandMember.ask(ctx, a, hello)
        assert isinstance(got, wire.JoinRefused) and got.code == "not_member", got
        assert _members(a) == {"a", "c"}
    finally:
        ctx.destroy(linger=0)


def test_a_cluster_file_from_before_keeps_its_members(tmp_path: Path) -> None:
    """An old data dir (no ``self_vouch`` field): a secret-file cluster is recognised by
    its secret's fingerprint, any other one takes no self-vouching."""
    import json

    from meshd.node.cluster_store import ClusterStore, StoredCluster

    store = ClusterStore(tmp_path)
    store.save(StoredCluster(key=b"k" * 32, name="old"))
    state = json.loads(store.state_file.read_text())
    del state["self_vouch"]
    store.state_file.write_text(json.dumps(state))
    assert store.load() == StoredCluster(key=b"k" * 32, name="old", self_vouch=False)
    state["secret_fp"] = "ab" * 16
    store.state_file.write_text(json.dumps(state))
    loaded = store.load()
    assert loaded is not None and loaded.self_vouch
    assert msgspec.json.decode(store.state_file.read_bytes())["name"] == "old"

"""Intruders made for real: a stranger on the LAN running stock `meshd up`, and clients
that speak meshd's wire protocol by hand, with and without a member's key.

What must hold: no prompt reaches a stranger, nobody but a member places or removes an
instance, and nothing anyone sends stops a node or rewrites what another node says
about itself (its card, its heartbeat).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from meshd.crdt.views import Health, NodeCard, health_key, node_key
from meshd.models import DEFAULT_MODEL
from meshd.node.joining import MAX_PENDING_PER_ADDRESS, approval_tag, new_approval_code
from meshd.transport import wire
from meshd.transport.identity import NodeKey, curve_public_of
from meshd.transport.security import PROTOCOL, CurveKeys, secure
from tests.cluster import Cluster, NodeProc, wait_for
from tests.netns import Host, Netns, require_netns

from .hand import HandMember

REPO = Path(__file__).resolve().parents[2]


def _dropped(n: NodeProc, reason: str) -> int:
    return n.get("/healthz")["dropped"].get("entries", {}).get(reason, 0)


def test_a_member_cannot_forge_another_nodes_card_or_heartbeat(cluster: Cluster) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    m = HandMember(cluster.secret_file, a)
    try:
        card = msgspec.convert(a.cluster()["nodes"][0]["card"], NodeCard)
        victim = card.id
        # The forged-twin claim: a's card with another incarnation, as if a wrote it.
        twin = msgspec.structs.replace(card, incarnation="forged", started_ms=1)
        stopped = Health(seq=10**9, state="stopped")
        reply = m.hello([
            m.forge(node_key(victim), twin, writer=victim),
            m.forge(health_key(victim), stopped, writer=victim),
            m.forge(health_key(b.node_id), stopped, writer=b.node_id),
        ])  # fmt: skip
        assert isinstance(reply, wire.Welcome)  # a member is answered...
        wait_for(lambda: _dropped(a, "bad_signature") >= 3, 5)  # ...its forgeries are not
        time.sleep(2.0)
        assert a.alive() and b.alive()
        for n in (a, b):
            assert n.liveness() == {"a": "alive", "b": "alive"}
            cards = {x["id"]: x["card"]["incarnation"] for x in n.cluster()["nodes"]}
            assert cards[victim] == card.incarnation
        assert "other process" not in a.log() and "exit code" not in a.log()
    finally:
        m.close()


def test_a_key_that_is_no_members_gets_nothing_in(cluster: Cluster) -> None:
    a = cluster.start("a")
    stranger = NodeKey.generate()
    ctx = zmq.Context()
    try:
        # No CURVE at all: the handshake fails, nothing is answered.
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVTIMEO, 2000)
        d.connect(f"tcp://127.0.0.1:{a.mesh_port}")
        d.send(wire.encode(wire.Hello(sender="x", cluster=b"", incarnation="x")))
        with pytest.raises(zmq.Again):
            d.recv()
        d.close()
        # CURVE with a key of its own and the node's own server key: likewise (ZAP).
        ident = HandMember.ask(ctx, a, wire.JoinWho())
        assert isinstance(ident, wire.JoinIdent)
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVTIMEO, 2000)
        secure(d, CurveKeys(*stranger.curve_pair()), server=False,
               server_key=curve_public_of(ident.key))  # fmt: skip
        d.connect(f"tcp://127.0.0.1:{a.mesh_port}")
        d.send(wire.encode(wire.Hello(sender="x", cluster=b"", incarnation="x")))
        with pytest.raises(zmq.Again):
            d.recv()
        d.close()
        # At the join desk: held for approval (never admitted by asking), a wrong proof
        # refused, junk dropped; a flood is rate limited and the pending list bounded.
        j = ctx.socket(zmq.DEALER)
        j.setsockopt(zmq.LINGER, 0)
        j.setsockopt(zmq.RCVTIMEO, 3000)
        j.connect(f"tcp://127.0.0.1:{a.mesh_port + 1}")
        tag = approval_tag(new_approval_code(), stranger.public)  # a code only eve shows
        hello = wire.JoinHello(
            name="eve", key=stranger.public, spake=b"A" * 33, tag=tag, protocol=PROTOCOL
        )
        j.send(wire.encode(hello))
        assert isinstance(msgspec.msgpack.decode(j.recv(), type=wire.JoinMessage),
                          wire.JoinPending)  # fmt: skip
        j.send(
            wire.encode(
                wire.JoinHello(name="eve", key=stranger.public, proof=b"x" * 32, protocol=PROTOCOL)
            )
        )
        got = msgspec.msgpack.decode(j.recv(), type=wire.JoinMessage)
        assert isinstance(got, wire.JoinRefused) and got.code == "bad_proof"
        for i in range(300):
            k = NodeKey.generate().public
            flood = wire.JoinHello(
                name=f"flood{i}", key=k, spake=b"A" * 33, tag=b"a", protocol=PROTOCOL
            )
            j.send(wire.encode(flood) if i % 2 else b"\x93junk")
        time.sleep(1.0)
        j.close()
        members = a.get("/v1/members")
        assert [x["name"] for x in members["data"]] == ["a"]
        assert len(members["pending"]) == MAX_PENDING_PER_ADDRESS  # per address: eve, 3 more
        assert a.alive() and a.get("/healthz")["status"] == "ok"
    finally:
        ctx.destroy(linger=0)


# -- a stranger on the LAN, with stock meshd ----------------------------------------------


def _up(host: Host, tmp: Path, name: str, *extra: str) -> subprocess.Popen[bytes]:
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    return host.popen(
        [sys.executable, "-m", "meshd.cli.meshd", "up", "--name", name,
         "--data-dir", str(tmp / name), *extra],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), "MESHD_THREADS": "1"},
    )  # fmt: skip


def _meshctl(host: Host, *args: str) -> subprocess.CompletedProcess[str]:
    return host.run([sys.executable, "-m", "meshd.cli.meshctl", *args], timeout=30)


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_a_stranger_running_stock_meshd_sees_no_prompt_and_changes_nothing(
    tmp_path: Path,
) -> None:
    require_netns()
    with Netns.lan(n=2, prefix="mdi") as lan:
        home, stranger = lan.hosts
        _up(home, tmp_path, "home", "--model", DEFAULT_MODEL)
        wait_for(lambda: "runner" in (tmp_path / "home.log").read_text()
                 and _meshctl(home, "ls").returncode == 0, 60)  # fmt: skip
        time.sleep(1.0)
        _up(stranger, tmp_path, "stranger")  # finds home on Bonjour, asks to join
        wait_for(lambda: "waiting for a member" in (tmp_path / "stranger.log").read_text(), 40)
        r = _meshctl(home, "members", "--json")
        assert '"stranger"' in r.stdout  # the owner sees who knocks...
        secret = "my bank PIN is 4921"
        body = json.dumps({"model": DEFAULT_MODEL, "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": secret}]})  # fmt: skip
        r = home.run(["curl", "-s", "-H", "Content-Type: application/json", "-d", body,
                      "http://127.0.0.1:7470/v1/chat/completions"], timeout=60)  # fmt: skip
        assert '"content"' in r.stdout, r.stdout
        # ...and the stranger is nowhere: no member, no stage, no API of its own.
        assert "stranger" not in [m for m in _meshctl(home, "ls").stdout.split()]
        assert _meshctl(stranger, "rm", "anything").returncode != 0
        assert _meshctl(stranger, "place", DEFAULT_MODEL, "--nodes", "stranger").returncode != 0
        assert secret not in (tmp_path / "stranger.log").read_text()
        assert "meshd ready" not in (tmp_path / "stranger.log").read_text()
        assert _meshctl(home, "ls").returncode == 0


def test_a_member_answering_hellos_under_a_nodes_id_stops_no_one(cluster: Cluster) -> None:
    """The twin claim replayed: a member that kept a's genuine card, signed by a in an
    earlier run, answers a's hellos under a's id with it (started first). A claim
    from the network stops no one: only a fresh challenge signed with a's key could."""
    a = cluster.start("a")
    m = HandMember(cluster.secret_file, a)
    try:
        welcome = m.hello([])
        assert isinstance(welcome, wire.Welcome)
        old = next(e for e in welcome.entries if e.key == node_key(a.node_id))
        card = msgspec.convert(a.cluster()["nodes"][0]["card"], NodeCard)
        assert a.terminate() == 0
        a = m.node = cluster.restart(a)
        m.introduce()
        router = m.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        secure(router, m.keys(), server=True)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        # Its own card (properly signed) points a at that ROUTER; with no heartbeat it is
        # never live, so a keeps greeting it.
        mine = msgspec.structs.replace(
            card, id=m.key.node_id, name="mallory", incarnation="m", mesh_port=port, pub_port=port
        )
        assert m.hello([m.forge(node_key(m.key.node_id), mine, writer=m.key.node_id)])
        answered = 0
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if router.poll(200):
                ident, _ = router.recv_multipart()
                replay = wire.Welcome(
                    sender=a.node_id, hlc=m.clock.now(), entries=[old],
                    incarnation=card.incarnation,
                )  # fmt: skip
                router.send_multipart([ident, wire.encode(replay)])
                answered += 1
        router.close()
        assert answered >= 1, "a never greeted the member: this test proves nothing"
        wait_for(lambda: "did not sign a fresh challenge" in a.log(), 10)
        assert "exit code" not in a.log() and a.alive()
    finally:
        m.close()

"""A secured cluster: CURVE on every socket, ZAP admitting members only, and what an
outsider can and cannot do.

Real `meshd up` processes on loopback (members by a shared secret file); the outsiders
are real nodes (no way in, another cluster's secret) and raw pyzmq sockets.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from meshd.crdt.hlc import pack
from meshd.crdt.lww import Entry
from meshd.models.resolve import DEFAULT_MODEL
from meshd.transport import wire
from meshd.transport.security import CurveKeys, secure, write_secret
from tests.cluster import Cluster, NodeProc, wait_for

from .hand import HandMember

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path, list]]:
    """Two members (a, b) with the secret, serving the default model split over both."""
    tmp = tmp_path_factory.mktemp("secured")
    secret = tmp / "secret"
    write_secret(secret)
    with Cluster(tmp) as c:
        flag = ["--secret-file", str(secret)]
        a = c.start("a", extra_args=flag)
        b = c.start("b", peers=[a], extra_args=flag)
        wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
        yield c, secret, [a, b]


def _names(n: NodeProc) -> set[str]:
    return {m["name"] for m in n.cluster()["nodes"]}


def _dropped(n: NodeProc) -> dict[str, dict[str, int]]:
    return n.get("/healthz")["dropped"]


def _handshake_failures(n: NodeProc, socket: str) -> int:
    return sum(v for k, v in _dropped(n).get(socket, {}).items() if k.startswith("handshake"))


def test_members_with_the_secret_serve_a_split_model(secured) -> None:
    _, _, (a, b) = secured
    assert a.get("/healthz")["secured"] is True
    r = httpx.post(
        a.api + "/v1/instances", json={"model": DEFAULT_MODEL, "nodes": ["a", "b"]}, timeout=30
    )
    assert r.status_code == 201, r.text
    inst = r.json()

    def ready() -> bool:
        return all(s["state"] == "ready" for s in a.get(f"/v1/instances/{inst['id']}")["stages"])

    wait_for(ready, 60, interval=0.2)
    body = {"model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    got = httpx.post(b.api + "/v1/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["completion_tokens"] == 8
    httpx.delete(f"{a.api}/v1/instances/{inst['id']}", timeout=10)


def test_a_node_with_no_way_in_waits_and_gets_nothing(secured) -> None:
    c, _, (a, b) = secured
    x = c.start("x-none", peers=[a], secret=False, wait=False)
    try:
        wait_for(lambda: "waiting for a member to approve" in x.log(), 20)
        time.sleep(2)  # many gossip rounds: nothing crosses
        assert "meshd ready" not in x.log()
        assert _names(a) == {"a", "b"} and _names(b) == {"a", "b"}
        assert [p["name"] for p in a.get("/v1/members")["pending"]] == ["x-none"]
    finally:
        x.proc.terminate()
        x.proc.wait(10)


def test_a_node_of_another_cluster_is_refused_at_the_door(secured, tmp_path: Path) -> None:
    c, _, (a, b) = secured
    other = tmp_path / "other"
    write_secret(other)
    x = c.start("x-other", peers=[a], extra_args=["--secret-file", str(other)])
    try:
        wait_for(lambda: _dropped(a).get("join", {}).get("bad_proof", 0) >= 1, 10)
        time.sleep(2)
        assert _names(a) == {"a", "b"} and _names(b) == {"a", "b"}
        assert _names(x) == {"x-other"}
    finally:
        x.proc.terminate()
        x.proc.wait(10)


def _raw_sub(port: int, keys=None, server_key: bytes | None = None) -> zmq.Socket:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    secure(s, keys, server=False, server_key=server_key or CurveKeys.generate().public)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def _read_for(sock: zmq.Socket, seconds: float) -> list[list[bytes]]:
    got = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            got.append(sock.recv_multipart())
    return got


def test_raw_subscriber_without_a_members_key_reads_nothing(secured) -> None:
    _, secret, (a, _b) = secured
    member = HandMember(secret, a)
    # Another server key than a's own; then a's key, with a client key no member holds.
    plain, other = _raw_sub(a.pub_port), _raw_sub(a.pub_port, CurveKeys.generate())
    unapproved = _raw_sub(a.pub_port, CurveKeys.generate(), member.server_key)
    right = _raw_sub(a.pub_port, member.keys(), member.server_key)
    try:
        # Heartbeats go out twice a second: the member's subscriber must see them, else
        # this test could not fail.
        assert _read_for(right, 2.0)
        assert _read_for(plain, 0.5) == []
        assert _read_for(other, 0.5) == []
        assert _read_for(unapproved, 0.5) == []
    finally:
        for s in (plain, other, unapproved, right):
            s.close(0)
        member.close()


def test_forged_hello_without_the_keys_changes_nothing(secured) -> None:
    _, _, (a, _b) = secured
    forged = Entry(
        key="node/ffffffffffffffff",
        value=msgspec.msgpack.encode({"name": "evil"}),
        hlc=pack(int(time.time() * 1000), 0),
        writer="ffffffffffffffff",
    )
    hello = wire.Hello(sender="ffffffffffffffff", cluster=wire.cluster_hash(
        a.get("/healthz")["cluster"]), incarnation="x", entries=[forged])  # fmt: skip
    for keys in (None, CurveKeys.generate()):
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        secure(d, keys, server=False, server_key=CurveKeys.generate().public)
        d.connect(f"tcp://127.0.0.1:{a.mesh_port}")
        d.send(wire.encode(hello))
        assert not d.poll(1000), "an outsider got an answer"
        d.close(0)
    assert _names(a) == {"a", "b"}
    assert not any(n["id"] == "ffffffffffffffff" for n in a.cluster()["nodes"])


def test_raw_dealer_without_the_keys_cannot_reach_the_data_plane(secured) -> None:
    _, _, (a, _b) = secured
    port = a.get("/healthz")["data_port"]
    before = _handshake_failures(a, "data")
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{port}")
    d.send(wire.encode(wire.DataChunk(req="r1", text="forged")))
    wait_for(lambda: _handshake_failures(a, "data") > before, 5)
    d.close(0)


def test_bad_secret_files_are_clear_errors(tmp_path: Path) -> None:
    import subprocess
    import sys

    weak = tmp_path / "weak"
    weak.write_text("short\n")
    for path, want in ((tmp_path / "missing", "cannot read"), (weak, "at least 16")):
        r = subprocess.run(
            [sys.executable, "-m", "meshd.cli.meshd", "up", "--secret-file", str(path),
             "--no-discovery", "--no-model", "--data-dir", str(tmp_path / "d")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert want in r.stderr

"""What a browser page or a slow client can do to a node's API: nothing that matters.

A real node on loopback and real sockets: a cross-site form post, a DNS-rebound Host, a
body of the wrong type, and 500 connections that never finish their headers.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from meshd.api.server import HEADER_TIMEOUT_S, MAX_CONNECTIONS_PER_IP, OVER_CAP_HEADER_TIMEOUT_S
from tests.cluster import Cluster

pytestmark = pytest.mark.timeout(120)

CHAT = '{"model": "x", "messages": [{"role": "user", "content": "hi"}]}'


def test_a_cross_site_form_post_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    a = cluster.start("a")
    before = a.get("/v1/instances")
    # What a page on another site can send without a CORS preflight: a form.
    r = httpx.post(a.api + "/v1/instances", content="model=smollm2-135m",
                   headers={"Content-Type": "application/x-www-form-urlencoded",
                            "Origin": "http://evil.example"}, timeout=10)  # fmt: skip
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_origin"
    # The same body without the Origin (curl -d): JSON only.
    r = httpx.post(a.api + "/v1/instances", content='{"model": "smollm2-135m"}',
                   headers={"Content-Type": "application/x-www-form-urlencoded"},
                   timeout=10)  # fmt: skip
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    # A typeless blob (fetch with a Blob body needs no preflight either).
    r = httpx.post(a.api + "/v1/chat/completions", content=CHAT.encode(), timeout=10)
    assert r.status_code == 415
    r = httpx.post(a.api + "/v1/chat/completions", content=CHAT,
                   headers={"Content-Type": "text/plain"}, timeout=10)  # fmt: skip
    assert r.status_code == 415
    assert a.get("/v1/instances") == before


def test_a_rebound_host_name_is_refused_and_the_nodes_own_names_are_not(
    cluster: Cluster,
) -> None:
    a = cluster.start("a")
    r = httpx.get(a.api + "/v1/cluster", headers={"Host": "evil.example"}, timeout=10)
    assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]
    port = a.api.rsplit(":", 1)[1]
    for host in ("127.0.0.1", "localhost", f"localhost:{port}", f"127.0.0.1:{port}"):
        r = httpx.get(a.api + "/v1/cluster", headers={"Host": host}, timeout=10)
        assert r.status_code == 200, (host, r.text)
    # The node's own origin (its UI, a page it serves) may post.
    r = httpx.get(a.api + "/healthz", headers={"Origin": f"http://127.0.0.1:{port}"}, timeout=10)
    assert r.status_code == 200


def test_half_open_connections_do_not_stop_a_normal_client(cluster: Cluster) -> None:
    a = cluster.start("a")
    host, port = a.api.removeprefix("http://").rsplit(":", 1)
    # 500 connections from another loopback address, each stuck inside its headers.
    held: list[socket.socket] = []
    try:
        for _ in range(500):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect((host, int(port)))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            held.append(s)
        t0 = time.monotonic()
        for _ in range(5):
            r = httpx.get(a.api + "/healthz", timeout=5)
            assert r.status_code == 200
        assert time.monotonic() - t0 < 5.0
        # Past twice the cap, the address's extra connections were closed at once,
        # those past the cap once their headers were a little late...
        time.sleep(0.5)
        closed = sum(1 for s in held if _closed(s))
        assert closed >= 500 - 2 * MAX_CONNECTIONS_PER_IP, closed
        time.sleep(OVER_CAP_HEADER_TIMEOUT_S)
        closed = sum(1 for s in held if _closed(s))
        assert closed >= 500 - MAX_CONNECTIONS_PER_IP, closed
        # ...and the rest go when their headers are late.
        time.sleep(HEADER_TIMEOUT_S + 1.0)
        assert all(_closed(s) for s in held)
        assert httpx.get(a.api + "/healthz", timeout=5).status_code == 200
    finally:
        for s in held:
            s.close()


def test_a_connection_past_the_cap_is_answered_429_in_its_dialect_not_reset(
    cluster: Cluster,
) -> None:
    a = cluster.start("a")
    host, port = a.api.removeprefix("http://").rsplit(":", 1)
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS_PER_IP):
            s = socket.socket()
            s.bind(("127.0.0.3", 0))
            s.connect((host, int(port)))
            held.append(s)
        transport = httpx.HTTPTransport(local_address="127.0.0.3")
        with httpx.Client(transport=transport, base_url=a.api, timeout=10) as c:
            for path, body_of in (
                ("/api/chat", lambda j: j["error"]),
                ("/v1/messages", lambda j: j["error"]["message"]),
                ("/v1/chat/completions", lambda j: j["error"]["message"]),
            ):
                r = c.post(path, content=CHAT, headers={"Content-Type": "application/json"})
                assert r.status_code == 429, r.text
                assert int(r.headers["Retry-After"]) >= 1
                assert "Too many connections" in body_of(r.json())
        # Another address is served as ever.
        assert httpx.get(a.api + "/healthz", timeout=5).status_code == 200
    finally:
        for s in held:
            s.close()


def _closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True

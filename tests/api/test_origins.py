"""Host and Origin, parsed strictly and port-exact: the real middleware, in-process.

A node's own names count only at its API's port (``http://localhost:8080`` is another
program's page), and a Host is a name, an address and a port, nothing more
(``localhost:7470.evil.com`` is evil.com's).
"""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message, Receive, Scope, Send

from meshd.api.origins import HostOriginGuard, allowed_hosts, parse_allowed

PORT = 7470
HOSTS = allowed_hosts(["192.168.1.5"], ["laptop"], allow=["proxy.example", "alt.example:9000"])


def _status(headers: dict[str, str]) -> int:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m: Message) -> None:
        sent.append(m)

    scope: Scope = {
        "type": "http", "method": "GET", "path": "/v1/models", "server": ("127.0.0.1", PORT),
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
    }  # fmt: skip
    asyncio.run(HostOriginGuard(app, HOSTS)(scope, receive, send))
    return int(sent[0]["status"])


@pytest.mark.parametrize(
    "host",
    ["localhost", f"localhost:{PORT}", f"127.0.0.1:{PORT}", f"[::1]:{PORT}", "LAPTOP.local",
     f"192.168.1.5:{PORT}", "proxy.example:443", "proxy.example", "alt.example:9000"],
)  # fmt: skip
def test_the_nodes_names_at_its_port_are_taken(host: str) -> None:
    assert _status({"host": host}) == 200


@pytest.mark.parametrize(
    "host",
    [f"localhost:{PORT}.evil.com", f"127.0.0.1:{PORT}.evil.com", "localhost:8080",
     f"localhost:{PORT}:{PORT}", "localhost:", "localhost:0", "localhost:99999",
     f"localhost@evil.com:{PORT}", "localhost/evil", "::1", f"[::1]x:{PORT}", "[::1",
     "evil.example", "alt.example", "alt.example:9001", "local host", "-localhost",
     "localhost\r\nX: y", ""],
)  # fmt: skip
def test_anything_else_is_refused(host: str) -> None:
    assert _status({"host": host}) == 403


@pytest.mark.parametrize(
    ("origin", "status"),
    [
        (f"http://localhost:{PORT}", 200),
        (f"https://127.0.0.1:{PORT}", 200),
        (f"http://[::1]:{PORT}", 200),
        ("https://proxy.example", 200),
        ("http://alt.example:9000", 200),
        ("http://localhost:8080", 403),  # another program's page on this machine
        ("http://localhost", 403),
        (f"http://localhost:{PORT}.evil.com", 403),
        (f"http://localhost:{PORT}@evil.com", 403),
        (f"http://localhost:{PORT}/x", 403),
        (f"ftp://localhost:{PORT}", 403),
        ("http://alt.example:9001", 403),
        ("null", 403),
        ("http://evil.example", 403),
    ],
)
def test_an_origin_is_this_node_only_at_its_port(origin: str, status: int) -> None:
    assert _status({"host": f"localhost:{PORT}", "origin": origin}) == status


def test_allow_host_entries_are_names_with_an_optional_port() -> None:
    assert parse_allowed("proxy.example") == ("proxy.example", None)
    assert parse_allowed("Proxy.Example:8443") == ("proxy.example", 8443)
    assert parse_allowed("fe80::1") == ("fe80::1", None)
    assert parse_allowed("[fe80::1]:8000") == ("fe80::1", 8000)
    for bad in ("http://x", "x:y", "a b", "x:70000", ""):
        assert parse_allowed(bad) is None, bad

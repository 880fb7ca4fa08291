"""Who may talk to the API from a browser: Host and Origin checks.

Two attacks come through the browser of someone on the LAN, not from the network:

* **DNS rebinding**: a page on ``evil.example`` re-resolves its own name to
  ``127.0.0.1`` and reads the node's API as same-origin. The browser still sends
  ``Host: evil.example``; a request whose Host is none of this node's names is refused.
* **Cross-site posts**: a page posts to ``http://127.0.0.1:7470`` from its own origin.
  The browser sends ``Origin: https://evil.example``; a request whose Origin is not this
  node's own is refused (JSON-only bodies already stop the posts that need no
  preflight, and no CORS header is ever sent, so a preflighted one fails too).

Clients that are not browsers (the ``openai`` SDK, curl, meshctl) send the Host they
dialled and no Origin. A node behind a reverse proxy or reached by another name is
told with ``meshd up --allow-host NAME``.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, dialect_of

__all__ = ["HostOriginGuard", "allowed_hosts"]

_LOOPBACK = ("localhost", "127.0.0.1", "::1", "localhost.localdomain")


def allowed_hosts(*groups: Iterable[str]) -> frozenset[str]:
    """Host names (lower case, no port, no brackets) this node answers to: loopback
    names and every name of the given groups (addresses, host names, ``--allow-host``)."""
    out = set(_LOOPBACK)
    for g in groups:
        for name in g:
            n = name.strip().lower().strip("[]")
            if n and n not in ("0.0.0.0", "::"):
                out.add(n)
                if "." not in n and ":" not in n:
                    out.add(n + ".local")  # the Bonjour name of a host name
    return frozenset(out)


def _host_of(value: str) -> str:
    """``example.org:80`` -> ``example.org``; ``[::1]:7470`` -> ``::1``."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1 : v.find("]")] if "]" in v else v[1:]
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def _forbidden(what: str) -> ApiError:
    return ApiError(
        403,
        f"{what}; a name this node is reached by is allowed with meshd up --allow-host NAME",
        type="authentication_error",
        code="forbidden_origin",
    )


class HostOriginGuard:
    """ASGI middleware: refuse a foreign ``Host`` or ``Origin`` with a 403."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str]) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            err = self._check(scope)
            if err is not None:
                await err.to_response(dialect_of(scope.get("path", "")))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> ApiError | None:
        for name, value in scope.get("headers", ()):
            if name == b"host":
                host = _host_of(value.decode("latin-1"))
                if host not in self.hosts:
                    return _forbidden(f"Host {host!r} is not a name of this node")
            elif name == b"origin":
                origin = value.decode("latin-1").strip()
                if origin == "null":
                    return _forbidden("requests from an opaque origin are refused")
                parts = urlsplit(origin)
                if parts.scheme not in ("http", "https") or (
                    (parts.hostname or "") not in self.hosts
                ):
                    return _forbidden(f"Origin {origin!r} is not this node")
        return None

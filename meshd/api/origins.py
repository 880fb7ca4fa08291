"""Who may talk to the API from a browser: Host and Origin checks.

Two attacks come through the browser of someone on the LAN, not from the network:

* **DNS rebinding**: a page on ``evil.example`` re-resolves its own name to
  ``127.0.0.1`` and reads the node's API as same-origin. The browser still sends
  ``Host: evil.example``; a request whose Host is none of this node's names is refused.
* **Cross-site posts**: a page posts to ``http://127.0.0.1:7470`` from its own origin.
  The browser sends ``Origin: https://evil.example``; a request whose Origin is not this
  node's own is refused (JSON-only bodies already stop the posts that need no
  preflight, and no CORS header is ever sent, so a preflighted one fails too).

Both checks are exact: a Host is parsed strictly (a host name, an IPv4 address or a
bracketed IPv6 one, an optional ``:port``, nothing else: ``localhost:7470.evil.com`` is
no name of this node), and a name of this node counts only at the port the API listens
on (``http://localhost:8080``, another program's page, is another origin). A Host
without a port is taken (the client dialled it; a browser always sends the port).

Clients that are not browsers (the ``openai`` SDK, curl, meshctl) send the Host they
dialled and no Origin. A node behind a reverse proxy or reached by another name is
told with ``meshd up --allow-host NAME[:PORT]`` (without a port, that name at any port:
the owner named it).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, dialect_of

__all__ = ["AllowedHosts", "HostOriginGuard", "allowed_hosts", "parse_allowed", "parse_host"]

log = logging.getLogger("meshd.api")

_LOOPBACK = ("localhost", "127.0.0.1", "::1", "localhost.localdomain")
_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")
_PORT = re.compile(r"[0-9]{1,5}")
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class AllowedHosts:
    """The names a request may carry: this node's own (at the API's port only), and
    those the owner allowed (at any port, or at the one port given)."""

    #: This node's names: loopback, its addresses and host names.
    own: frozenset[str]
    #: ``--allow-host NAME``: that name, any port.
    any_port: frozenset[str] = frozenset()
    #: ``--allow-host NAME:PORT``: that name at that port.
    exact: frozenset[tuple[str, int]] = frozenset()

    def allows(self, name: str, port: int | None, api_port: int | None) -> bool:
        """Whether ``name`` (lower case, no brackets) at ``port`` (None: not said) is
        this node, whose API listens at ``api_port`` (None: not known)."""
        if name in self.any_port or (port is not None and (name, port) in self.exact):
            return True
        return name in self.own and (port is None or api_port is None or port == api_port)


def parse_host(value: str) -> tuple[str, int | None] | None:
    """``Host`` header -> (name, port); None for anything but a host name, an IPv4
    address or a bracketed IPv6 one, with an optional ``:port`` (1-65535)."""
    v = value.strip().lower()
    port: int | None = None
    if v.startswith("["):
        end = v.find("]")
        if end < 0:
            return None
        name, rest = v[1:end], v[end + 1 :]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
    else:
        name, sep, rest = v.partition(":")
        rest = sep + rest
        if _NAME.fullmatch(name) is None or len(name) > 253:
            return None
        name = name.rstrip(".")
    if rest:
        if not rest.startswith(":") or _PORT.fullmatch(rest[1:]) is None:
            return None
        port = int(rest[1:])
        if not 0 < port < 65536:
            return None
    return name, port


def parse_allowed(entry: str) -> tuple[str, int | None] | None:
    """An ``--allow-host`` entry -> (name, port); None for one that is no host."""
    e = entry.strip()
    # A bare IPv6 address (``fe80::1``) is a name, not a name and a port.
    return parse_host(f"[{e}]" if e.count(":") > 1 and not e.startswith("[") else e)


def allowed_hosts(*groups: Iterable[str], allow: Iterable[str] = ()) -> AllowedHosts:
    """This node's names: loopback names and every name of the given groups (addresses,
    host names); ``allow``: ``--allow-host`` entries, ``NAME`` or ``NAME:PORT`` (one
    that is neither is left out, with a warning: ``meshd up`` refuses it earlier)."""
    own = set(_LOOPBACK)
    for g in groups:
        for name in g:
            n = name.strip().lower().strip("[]")
            if n and n not in ("0.0.0.0", "::"):
                own.add(n)
                if "." not in n and ":" not in n:
                    own.add(n + ".local")  # the Bonjour name of a host name
    any_port: set[str] = set()
    exact: set[tuple[str, int]] = set()
    for entry in allow:
        parsed = parse_allowed(entry)
        if parsed is None:
            log.warning("allow_hosts entry %r is no host name or address: left out", entry)
            continue
        name, port = parsed
        if port is None:
            any_port.add(name)
        else:
            exact.add((name, port))
    return AllowedHosts(frozenset(own), frozenset(any_port), frozenset(exact))


def _forbidden(what: str) -> ApiError:
    return ApiError(
        403,
        f"{what}; a name this node is reached by is allowed with meshd up --allow-host NAME",
        type="authentication_error",
        code="forbidden_origin",
    )


class HostOriginGuard:
    """ASGI middleware: refuse a foreign ``Host`` or ``Origin`` with a 403."""

    def __init__(self, app: ASGIApp, hosts: AllowedHosts) -> None:
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
        server = scope.get("server")
        api_port = server[1] if server and isinstance(server[1], int) else None
        for name, value in scope.get("headers", ()):
            if name == b"host":
                raw = value.decode("latin-1")
                host = parse_host(raw)
                if host is None or not self.hosts.allows(*host, api_port):
                    return _forbidden(f"Host {raw[:200]!r} is not a name of this node")
            elif name == b"origin":
                err = self._origin(value.decode("latin-1").strip(), api_port)
                if err is not None:
                    return err
        return None

    def _origin(self, origin: str, api_port: int | None) -> ApiError | None:
        if origin == "null":
            return _forbidden("requests from an opaque origin are refused")
        try:
            parts = urlsplit(origin)
            port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
        except ValueError:
            return _forbidden(f"Origin {origin[:200]!r} is not this node")
        # An origin is scheme://host[:port] and nothing more.
        tail = parts.path or parts.query or parts.fragment or parts.username is not None
        netloc = parse_host(parts.netloc)
        if (
            parts.scheme not in _DEFAULT_PORTS
            or tail
            or netloc is None
            or not self.hosts.allows(netloc[0], port, api_port)
        ):
            return _forbidden(f"Origin {origin[:200]!r} is not this node")
        return None

"""Who may call each route of the API, and the credentials that say so.

Every route is a :class:`Guarded` route naming its :class:`Access`; ``app.ROUTES`` is
the one table of them, and :class:`AccessGuard` refuses to serve a route without one.

* ``OPEN``: anyone (``/healthz``: liveness probes run before anyone holds a key).
* ``USE``: inference (every dialect), listing models, reading the cluster's state.
  Anyone who reaches the API, unless the node has an API key (``--api-key-file``,
  ``$MESHD_API_KEY``): then that key, as ``Authorization: Bearer KEY`` (what OpenAI and
  Ollama clients send) or ``x-api-key: KEY`` (Anthropic's). A request for a model that
  is not placed still places it, as it always did.
* ``ADMIN``: changing the cluster (invites, approving and removing members, placing and
  removing instances, Ollama's pull and delete). Only with an admin credential in the
  ``x-meshd-admin`` header: the node owner's token (``owner.token`` in its data dir,
  0600: what ``meshctl`` sends, with no flag, when its user can read the file), good
  from the node's own machine only; or the admin key for remote administration
  (``--admin-key-file``, ``$MESHD_ADMIN_KEY``). The API key never opens these routes:
  an inference client's Bearer key is not an admin's. An admin credential opens the
  ``USE`` routes too.

Every request to an ``ADMIN`` route, served or refused, is one line on the
``meshd.audit`` logger: what (method and path), who (the owner, or the admin key, and
the peer's address), the outcome (the status).
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, dialect_of
from .limits import client_id, set_client

__all__ = [
    "ADMIN_HEADER",
    "Access",
    "AccessGuard",
    "Guarded",
    "access_of",
    "invalid_api_key",
    "route_of",
]

audit = logging.getLogger("meshd.audit")

#: The header an admin credential travels in (never ``Authorization``: that is where
#: inference clients put the API key).
ADMIN_HEADER = "x-meshd-admin"
_ADMIN = ADMIN_HEADER.encode()

#: How to get the credential, for every refusal of an admin route.
HOW = (
    "run meshctl on the node's machine as the user who runs meshd, against its loopback "
    "address (it sends the owner token kept in the node's data dir; --data-dir or "
    "$MESHD_DATA_DIR if not the default), or pass meshctl --admin-key-file PATH for a "
    "node started with --admin-key-file (other clients send it as the x-meshd-admin header)"
)


class Access(enum.Enum):
    """Who may call a route."""

    OPEN = "open"  # anyone, never a key
    USE = "use"  # inference and reading: the API key when the node has one
    ADMIN = "admin"  # changes the cluster: the owner token or the admin key


class Guarded(Route):
    """A route and who may call it."""

    def __init__(
        self, access: Access, path: str, endpoint: Callable[..., Any], *, methods: Collection[str]
    ) -> None:
        super().__init__(path, endpoint, methods=list(methods))
        self.access = access


def route_of(routes: Sequence[BaseRoute], scope: Scope) -> BaseRoute | None:
    """The route that takes a request, found as the router finds it: the first full
    match (None: a path no route has, or a method its route lacks)."""
    for r in routes:
        match, _ = r.matches(scope)
        if match is Match.FULL:
            return r
    return None


def access_of(routes: Sequence[BaseRoute], scope: Scope) -> Access:
    """The access a request needs: its route's. A path no route has, or a method its
    route lacks, needs ``USE`` (its answer is a 404 or 405, or a redirect to the path
    without its trailing slash, which does nothing)."""
    r = route_of(routes, scope)
    if r is None:
        return Access.USE
    return r.access if isinstance(r, Guarded) else Access.ADMIN


def invalid_api_key(provided: bool) -> ApiError:
    """401 ``invalid_api_key`` (the ``openai`` client raises ``AuthenticationError``)."""
    msg = (
        "Incorrect API key provided."
        if provided
        else "You didn't provide an API key; send it as 'Authorization: Bearer KEY' "
        "(or 'x-api-key: KEY')."
    )
    return ApiError(401, msg, type="authentication_error", code="invalid_api_key")


def _admin_error(status: int, code: str, message: str) -> ApiError:
    return ApiError(status, message, type="authentication_error", code=code)


def _loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def _printable(text: str, limit: int = 200) -> str:
    """``text`` fit for one log line: control characters escaped, bounded."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + ("…" if len(text) > limit else "")


def _same(given: bytes, key: bytes | None) -> bool:
    # Constant time: the comparison must not leak how much of a guess was right.
    return key is not None and hmac.compare_digest(given, key)


class AccessGuard:
    """ASGI middleware: each request gets the access its route needs, or a 401/403 in
    its dialect's shape; each request to an admin route is audited."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Sequence[BaseRoute],
        api_key: str | None,
        admin_key: str | None,
        owner_token: str | None,
    ) -> None:
        if not all(isinstance(r, Guarded) for r in routes):
            raise TypeError("every route names its access (create_app says which do not)")
        self.app = app
        self._routes = list(routes)
        self._api_key = api_key.encode() if api_key else None
        self._admin_key = admin_key.encode() if admin_key else None
        self._owner = owner_token.encode() if owner_token else None
        #: (method, path) of a route with no parameters -> its access: a request's
        #: route is found once per path, not on every request (a scan of every route
        #: costs tens of microseconds).
        self._known: dict[tuple[str, str], Access] = {}

    def _access(self, scope: Scope) -> Access:
        key = (scope.get("method", ""), scope.get("path", ""))
        known = self._known.get(key)
        if known is not None and not scope.get("root_path"):
            return known
        r = route_of(self._routes, scope)
        if r is None:
            return Access.USE
        assert isinstance(r, Guarded)
        if isinstance(r, Route) and not r.param_convertors and not scope.get("root_path"):
            self._known[key] = r.access  # bounded: one entry per static route and method
        return r.access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access = self._access(scope)
        if access is Access.OPEN:
            await self.app(scope, receive, send)
            return
        bearer, admin = _credentials(scope)
        client = scope.get("client")
        host = client[0] if client else ""
        who = self._who(admin, host)
        if access is Access.USE:
            if who or self._api_key is None or _same(bearer, self._api_key):
                # Who asks, for the turns the queues take (the task is this request's).
                set_client(client_id(bearer, host, self._api_key))
                await self.app(scope, receive, send)
                return
            refusal = invalid_api_key(bool(bearer))
        elif who:
            await self._audited(scope, receive, send, f"by {who} from {host or '?'}")
            return
        else:
            refusal = self._refusal(_what(scope), admin, bearer, host)
            audit.warning("%s refused (%s) from %s: %d", _what(scope), refusal.code,
                          host or "?", refusal.status)  # fmt: skip
        resp = refusal.to_response(dialect_of(scope.get("path", "")))
        resp.headers["WWW-Authenticate"] = "Bearer" if access is Access.USE else "MeshdAdmin"
        await resp(scope, receive, send)

    def _who(self, given: bytes, host: str) -> str:
        """Who the ``x-meshd-admin`` credential makes the caller ("": no admin)."""
        if not given:
            return ""
        if _same(given, self._admin_key):
            return "admin key"
        if _same(given, self._owner) and _loopback(host):
            return "owner"
        return ""

    def _refusal(self, what: str, given: bytes, bearer: bytes, host: str) -> ApiError:
        """Why an admin route is refused to this caller, and how to get the credential."""
        if not given and _same(bearer, self._api_key):
            return _admin_error(
                403, "admin_required",
                f"The API key opens inference only: {what} administers the cluster, with "
                f"the node owner's credential. To get it, {HOW}.",
            )  # fmt: skip
        if not given:
            return _admin_error(
                401, "admin_required",
                f"{what} administers the cluster: it needs the node owner's credential. "
                f"To get it, {HOW}.",
            )  # fmt: skip
        if _same(given, self._owner):
            return _admin_error(
                403, "owner_token_remote",
                f"The owner token works on the node's own machine only, not from {host}; "
                "for remote administration start the node with --admin-key-file and pass "
                "meshctl --admin-key-file PATH.",
            )  # fmt: skip
        return _admin_error(
            401, "invalid_admin_key",
            f"The {ADMIN_HEADER} credential is neither this node's owner token nor its "
            f"admin key. To get one, {HOW}.",
        )  # fmt: skip

    async def _audited(self, scope: Scope, receive: Receive, send: Send, who: str) -> None:
        """Serve an admin request, then log what it was, who asked, and the status."""
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            audit.info("%s %s: %s", _what(scope), who, status or "no answer")


def _what(scope: Scope) -> str:
    return f"{scope.get('method', '?')} {_printable(scope.get('path', ''))}"


def _credentials(scope: Scope) -> tuple[bytes, bytes]:
    """The API key (Bearer or ``x-api-key``) and the admin credential a request carries."""
    bearer = admin = b""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                bearer = token.strip() or bearer
        elif name == b"x-api-key":
            bearer = value.strip() or bearer
        elif name == _ADMIN:
            admin = value.strip() or admin
    return bearer, admin

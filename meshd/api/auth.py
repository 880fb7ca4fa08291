"""API keys: ``meshd up --api-key KEY`` makes every route but ``/healthz`` demand the
key, as ``Authorization: Bearer KEY`` (what OpenAI and Ollama clients send) or as
``x-api-key: KEY`` (what Anthropic clients send)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, dialect_of

__all__ = ["OPEN_PATHS", "BearerAuth", "invalid_api_key"]

#: Answered without a key: liveness probes must work before anyone has one.
OPEN_PATHS = frozenset({"/healthz"})


def invalid_api_key(provided: bool) -> ApiError:
    """401 ``invalid_api_key`` (the ``openai`` client raises ``AuthenticationError``)."""
    msg = (
        "Incorrect API key provided."
        if provided
        else "You didn't provide an API key; send it as 'Authorization: Bearer KEY' "
        "(or 'x-api-key: KEY')."
    )
    return ApiError(401, msg, type="authentication_error", code="invalid_api_key")


class BearerAuth:
    """ASGI middleware: a request without the right key gets a 401 (in its dialect)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip() or given
            elif name == b"x-api-key":
                given = value.strip() or given
        # Constant time: the comparison must not leak how much of a guess was right.
        if given and hmac.compare_digest(given, self._key):
            await self.app(scope, receive, send)
            return
        resp = invalid_api_key(bool(given)).to_response(dialect_of(scope.get("path", "")))
        resp.headers["WWW-Authenticate"] = "Bearer"
        await resp(scope, receive, send)

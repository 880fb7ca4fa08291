"""Request ids: every API request gets one, in its response's ``X-Request-Id`` header and
on every log line written while it is served (:func:`meshd.logs.request_scope`).

The node passes the id on as the prefix of the pipeline request ids it sends the stages
(``<id>.<attempt>``), so ``grep <id>`` over any node's log shows the request's path:
its stages, replays and errors. A client may send its own ``X-Request-Id`` (letters,
digits, ``-`` and ``_``, up to 64) to correlate with its logs.
"""

from __future__ import annotations

import re
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshd.logs import request_scope

__all__ = ["HEADER", "RequestIds", "new_request_id"]

HEADER = "x-request-id"
_SANE = re.compile(rb"[A-Za-z0-9_-]{1,64}")


def new_request_id() -> str:
    """A fresh id: 16 hex digits."""
    return secrets.token_hex(8)


class RequestIds:
    """ASGI middleware: an id for each HTTP request, in scope while it is served."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(HEADER.encode())
        rid = given.decode() if given and _SANE.fullmatch(given) else new_request_id()

        async def _send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                headers.append((HEADER.encode(), rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        with request_scope(rid):
            await self.app(scope, receive, _send)

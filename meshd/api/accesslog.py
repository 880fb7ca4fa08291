"""One log line for every HTTP request, whatever its outcome.

A request refused anywhere (a foreign Host, no API key, a body that is no JSON, a model
the cluster lacks, a full node) is logged as one served: method, path, status, time
taken and the client's address, with the request id (:mod:`.requestid`, outside this
middleware) at the end as on every line written for the request. A request that ran on
the pipeline adds what its runs report (:func:`note_run`: the model, the stages it went
through, tokens, time to first token) to the same line, so one request is one line.

Reads that succeed (``GET``/``HEAD`` below 400) are logged at debug level: ``meshctl
top``, dashboards and health checks poll every second, and their lines would bury the
ones that matter. Everything else is at info.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["AccessLog", "note_run", "request_started"]

log = logging.getLogger("meshd.api")

#: The run summaries of the request being served (None: no request is being served).
_RUNS: ContextVar[list[str] | None] = ContextVar("meshd_runs", default=None)
#: When the request being served came in (perf_counter; None: none is being served).
_STARTED: ContextVar[float | None] = ContextVar("meshd_started", default=None)
#: A path is logged up to this long (a client may send a very long one).
_MAX_PATH = 200


def request_started() -> float | None:
    """When the HTTP request being served came in (``time.perf_counter``), if one is."""
    return _STARTED.get()


def note_run(summary: str) -> bool:
    """Add a run's summary to the line of the request being served; False when no
    request is being served here (the caller logs the summary itself)."""
    runs = _RUNS.get()
    if runs is None:
        return False
    # The list, not the variable, is shared: a streamed body is written by a task that
    # starts with a copy of the request's context, holding this same list.
    runs.append(summary)
    return True


class AccessLog:
    """ASGI middleware: one log line per HTTP request, once its response has ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0
        runs: list[str] = []
        token = _RUNS.set(runs)
        started = _STARTED.set(t0)

        async def _send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            _RUNS.reset(token)
            _STARTED.reset(started)
            _log_line(scope, status, time.perf_counter() - t0, runs)


def _log_line(scope: Scope, status: int, took: float, runs: list[str]) -> None:
    method = str(scope.get("method", "?"))
    read = method in ("GET", "HEAD") and 0 < status < 400
    level = logging.DEBUG if read else logging.INFO
    if not log.isEnabledFor(level):
        return
    path = str(scope.get("path", ""))
    if len(path) > _MAX_PATH:
        path = path[:_MAX_PATH] + "..."
    client = scope.get("client")
    who = f" from {client[0]}" if client else ""
    # 0: the app ended without a response (the server answers 500, or the client left).
    line = f"{method} {path} {status or '-'} {took:.3f}s{who}"
    if runs:
        line += ": " + "; ".join(runs)
    log.log(level, "%s", line)

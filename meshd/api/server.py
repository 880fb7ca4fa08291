"""uvicorn on the node's own event loop, on a socket bound beforehand (so port 0 works
and the port is known before the node announces itself).

Connections are bounded: a client address holds at most :data:`MAX_CONNECTIONS_PER_IP`
connections: as many again past it are answered 429 with ``Retry-After``, in the
dialect of the path they ask for, and closed (a client learns why and when to come
back, where a reset would look like a crash), within :data:`OVER_CAP_HEADER_TIMEOUT_S`
for their headers; more are closed at once. The server holds at most
:data:`MAX_CONNECTIONS` (file descriptors are finite), and a connection must finish
sending its request headers within :data:`HEADER_TIMEOUT_S` (uvicorn's h11 protocol
has no such limit: a slowloris client would hold its connections forever).
Bodies have their own limit (``bodies.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections import Counter
from collections.abc import Callable, Generator
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .accesslog import AccessLog
from .errors import OVERLOADED_RETRY_S, ApiError, dialect_of
from .requestid import RequestIds

__all__ = [
    "HEADER_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_CONNECTIONS_PER_IP",
    "OVER_CAP_HEADER_TIMEOUT_S",
    "ApiServer",
    "bind_api",
]

log = logging.getLogger("meshd.api")

#: A connection that has not sent complete request headers this long after it opened
#: (or after its previous response) is closed.
HEADER_TIMEOUT_S = 10.0
#: The same for a connection past its address's cap (it only gets its 429).
OVER_CAP_HEADER_TIMEOUT_S = 2.0
#: Open connections one client address may hold; more are answered 429 and closed.
MAX_CONNECTIONS_PER_IP = 128
#: Connections waiting to be accepted (a burst of clients connecting at once must not
#: overflow it: the kernel would drop or reset them).
LISTEN_BACKLOG = 1024
#: Open connections in all; more are closed at once (file descriptors are finite, and a
#: device with many addresses must not take them all).
MAX_CONNECTIONS = 1024
#: The key of the total in the connection counter (no client address is empty-bracketed).
_ALL = "[all]"


class _Guarded(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and connection caps (per address,
    in all)."""

    def __init__(
        self, *args: Any, per_ip: Counter[str], retry_after: Callable[[], float], **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self._per_ip = per_ip
        self._retry_after = retry_after
        self._ip = ""
        self._deadline: asyncio.TimerHandle | None = None
        self._header_s = HEADER_TIMEOUT_S

    def connection_made(
        self,
        transport: asyncio.Transport,  # type: ignore[override]  # uvicorn's own type
    ) -> None:
        super().connection_made(transport)
        self._ip = self.client[0] if self.client else ""
        self._per_ip[self._ip] += 1
        self._per_ip[_ALL] += 1
        held = self._per_ip[self._ip]
        if self._per_ip[_ALL] > MAX_CONNECTIONS or held > 2 * MAX_CONNECTIONS_PER_IP:
            transport.close()
            return
        if held > MAX_CONNECTIONS_PER_IP:
            # Its requests get the refusal instead of the app (uvicorn runs self.app),
            # with an id and a log line as every request.
            refuse = functools.partial(_too_many_connections, retry_after=self._retry_after())
            self.app = RequestIds(AccessLog(refuse))
            self._header_s = OVER_CAP_HEADER_TIMEOUT_S
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        for key in (self._ip, _ALL):
            self._per_ip[key] -= 1
            if self._per_ip[key] <= 0:
                del self._per_ip[key]
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None:
            self._disarm()  # a request is in: its body and handler have their own limits

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets the same deadline

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self._header_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


async def _too_many_connections(
    scope: Scope, receive: Receive, send: Send, *, retry_after: float
) -> None:
    """A request on a connection past its address's cap: 429, and the connection closes."""
    if scope["type"] != "http":
        return
    err = ApiError(
        429, f"Too many connections from this address (at most {MAX_CONNECTIONS_PER_IP} "
        "at once); close some, or retry later.", type="rate_limit_error",
        code="too_many_connections", retry_after=retry_after,
    )  # fmt: skip
    resp = err.to_response(dialect_of(scope.get("path", "")))
    resp.headers["Connection"] = "close"
    await resp(scope, receive, send)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The node owns SIGINT/SIGTERM: it must say goodbye to peers before exiting.
        yield


def bind_api(host: str, port: int) -> socket.socket:
    """The API's listening socket; ``port`` 0 takes one the OS picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only
    # when the listener says so, and without it every response's last segment waits
    # for the client's delayed ACK (~40 ms a request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno, f"cannot listen on {host}:{port} for the API: {e.strerror}"
        ) from None
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


class ApiServer:
    """Serves an app on a bound socket until stopped."""

    def __init__(
        self,
        app: ASGIApp,
        sock: socket.socket,
        *,
        stop_grace: float,
        retry_after: Callable[[], float] = lambda: OVERLOADED_RETRY_S,
    ) -> None:
        """``retry_after``: the Retry-After of a connection past its address's cap
        (the admission's estimate, see ``limits.Admission.retry_after``)."""
        # h11 always: uvicorn would pick httptools when it happens to be installed, and
        # the two parsers answer malformed requests differently (httptools refuses any
        # method it does not know with a bare text 400, before the app can say why).
        guarded = functools.partial(_Guarded, per_ip=Counter(), retry_after=retry_after)
        config = uvicorn.Config(
            app,
            http=guarded,  # type: ignore[arg-type]  # a partial: uvicorn calls it like the class
            log_level="warning",
            # No handlers of uvicorn's own: its lines go through the process's logging
            # (meshd.logs), JSON included, like every other line of a node's log.
            log_config=None,
            lifespan="off",
            access_log=False,
        )
        self._server = _Server(config)
        self._sock = sock
        self._stop_grace = stop_grace
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start serving (returns once the server accepts)."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="api")
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop accepting, finish in-flight responses (bounded by the grace), close."""
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, self._stop_grace)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()

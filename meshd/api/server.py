"""uvicorn on the node's own event loop, on a socket bound beforehand (so port 0 works
and the port is known before the node announces itself)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator

import uvicorn
from starlette.types import ASGIApp

__all__ = ["ApiServer", "bind_api"]


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
    sock.listen(128)
    sock.setblocking(False)
    return sock


class ApiServer:
    """Serves an app on a bound socket until stopped."""

    def __init__(self, app: ASGIApp, sock: socket.socket, *, stop_grace: float) -> None:
        # h11 by name: uvicorn would pick httptools when it happens to be installed, and
        # the two parsers answer malformed requests differently (httptools refuses any
        # method it does not know with a bare text 400, before the app can say why).
        config = uvicorn.Config(
            app, http="h11", log_level="warning", lifespan="off", access_log=False
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

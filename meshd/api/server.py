"""uvicorn on the node's own event loop, on a socket we bind (so port 0 works)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator

import uvicorn

from .app import NodeView, create_app


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The node owns SIGINT/SIGTERM: it must say goodbye to peers before exiting.
        yield


class ApiServer:
    """Serves the node's API until stopped."""

    def __init__(self, node: NodeView) -> None:
        self.app = create_app(node)
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind and start serving; return the bound port."""
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
        bound = sock.getsockname()[1]
        # h11 by name: uvicorn would pick httptools when it happens to be installed, and
        # the two parsers answer malformed requests differently (httptools refuses any
        # method it does not know with a bare text 400, before the app can say why).
        config = uvicorn.Config(
            self.app, http="h11", log_level="warning", lifespan="off", access_log=False
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="api")
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        return bound

    async def stop(self) -> None:
        """Stop accepting, finish in-flight responses (bounded), close."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, 5.0)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()

"""The API node's end of the data plane: send requests to runners, demux DataChunks.

Runners bind their own ROUTERs (see ``meshd.engines.runner``). The node that owns a
request sends ``Generate``/``Release`` to them over DEALERs and receives every
``DataChunk`` on one ROUTER of its own, advertised as ``data_port`` in its card.
Chunks are handed to the request's queue by request id; chunks of unknown requests
(finished, cancelled) are dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from . import wire
from .addresses import choose_address
from .gossip import configure
from .security import ClusterKeys, HandshakeReporter, secure, watch_handshakes
from .stats import DropCounters

log = logging.getLogger("meshd.dataplane")


def endpoint(addr: wire.Addr, own_addresses: list[str]) -> str:
    """ZeroMQ address of ``addr`` as seen from a host with ``own_addresses``."""
    host = choose_address(own_addresses, addr.addresses) if addr.addresses else "127.0.0.1"
    if host == "127.0.0.1" and host not in addr.addresses and addr.addresses:
        host = next((a for a in addr.addresses if a in own_addresses), addr.addresses[0])
    return f"tcp://[{host}]:{addr.port}" if ":" in host else f"tcp://{host}:{addr.port}"


class DataPlane:
    """Sockets of the request-owning side of the data plane."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        node_id: str,
        own_addresses: list[str],
        bind_host: str = "0.0.0.0",
        counters: DropCounters | None = None,
        keys: ClusterKeys | None = None,
    ) -> None:
        self.ctx = ctx
        self.keys = keys
        self.node_id = node_id
        self.own_addresses = own_addresses
        self.counters = counters or DropCounters()
        self.router = ctx.socket(zmq.ROUTER)
        configure(self.router)
        secure(self.router, keys, server=True)
        host = f"[{bind_host}]" if ":" in bind_host else bind_host
        self.router.bind(f"tcp://{host}:0")
        self.port = int(self.router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._streams: dict[str, asyncio.Queue[wire.DataChunk]] = {}
        self._dealers: dict[str, zmq.asyncio.Socket] = {}
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None

    def reply_addr(self) -> wire.Addr:
        """Where runners send this node's DataChunks."""
        return wire.Addr(node=self.node_id, addresses=self.own_addresses, port=self.port)

    def start(self) -> None:
        """Start receiving chunks."""
        self._task = asyncio.create_task(self._recv_loop(), name="dataplane-recv")
        if self.keys is not None:
            reporter = HandshakeReporter(self.counters.add)
            self._watch = asyncio.create_task(
                watch_handshakes(self.router, "data", reporter), name="hs-data"
            )

    async def stop(self) -> None:
        """Stop receiving; close every socket."""
        for t in (self._task, self._watch):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        for d in self._dealers.values():
            d.close(linger=0)
        self.router.close(linger=0)

    def open(self, req: str) -> asyncio.Queue[wire.DataChunk]:
        """Start collecting the chunks of request ``req``."""
        q: asyncio.Queue[wire.DataChunk] = asyncio.Queue()
        self._streams[req] = q
        return q

    def close(self, req: str) -> None:
        """Stop collecting chunks of ``req``; later ones are dropped."""
        self._streams.pop(req, None)

    def in_flight(self) -> int:
        """Requests this node currently owns."""
        return len(self._streams)

    async def send(self, addr: wire.Addr, msg: wire.Message, *frames: bytes) -> None:
        """Send one message (plus raw frames) to a runner's ROUTER. Never blocks long:
        a runner that is gone makes the DEALER queue, bounded by its HWM."""
        ep = endpoint(addr, self.own_addresses)
        d = self._dealers.get(ep)
        if d is None:
            d = self.ctx.socket(zmq.DEALER)
            configure(d)
            secure(d, self.keys, server=False)
            d.setsockopt(zmq.SNDHWM, 1000)
            d.connect(ep)
            self._dealers[ep] = d
        await d.send_multipart([wire.encode(msg), *frames], flags=zmq.NOBLOCK)

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart(copy=True)
            try:
                self._on_frames(frames)
            except Exception:  # one bad frame must never stop every request's output
                log.exception("error handling a data-plane frame")
                self.counters.add("data", "error")

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.counters.add("data", "shape")
            return
        try:
            msg = wire.decode(frames[1])
        except wire.FrameError as e:
            self.counters.add("data", e.reason)
            return
        if not isinstance(msg, wire.DataChunk):
            self.counters.add("data", "unexpected")
            return
        q = self._streams.get(msg.req)
        if q is None:
            self.counters.add("data", "unknown_request")
            return
        q.put_nowait(msg)

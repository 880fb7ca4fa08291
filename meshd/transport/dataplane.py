"""The API node's end of the data plane: send requests to runners, demux DataChunks.

Runners bind their own ROUTERs (see ``meshd.engines.runner``). The node that owns a
request sends ``Generate``/``Release`` to them over DEALERs and receives every
``DataChunk`` on one ROUTER of its own, advertised as ``data_port`` in its card.
Chunks are handed to the request's queue by request id; chunks of unknown requests
(finished, cancelled), from a sender that is not one of the request's stages (told
by its authenticated CURVE key), or past a request's queue bound are dropped and
counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from . import wire
from .security import CurveKeys, HandshakeReporter, NoServerKey, sender_key, watch_handshakes
from .sockets import DATA, DealerCache, bind, decode_frame, open_socket
from .stats import DropCounters

log = logging.getLogger("meshd.dataplane")

#: Chunks one request may have waiting unread (a reader that stopped reading is gone;
#: the request's own timeouts end it).
MAX_QUEUED_CHUNKS = 4096


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
        keys: CurveKeys | None = None,
        server_key: Callable[[str], bytes | None] = lambda node: None,
    ) -> None:
        self.ctx = ctx
        self.keys = keys
        self.node_id = node_id
        self.own_addresses = own_addresses
        self.counters = counters or DropCounters()
        self.router = open_socket(ctx, zmq.ROUTER, DATA, keys, server=True)
        self.port = bind(self.router, bind_host)
        self._streams: dict[str, asyncio.Queue[wire.DataChunk]] = {}
        #: Request id -> the CURVE keys (Z85) of its stages: the only senders taken.
        self._senders: dict[str, frozenset[bytes]] = {}
        self._dealers = DealerCache(
            ctx, keys=keys, own_addresses=own_addresses, server_key=server_key
        )
        self._drop = lambda reason: self.counters.add("data", reason)
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
        self._dealers.close()
        self.router.close(linger=0)

    def open(
        self, req: str, senders: frozenset[bytes] | None = None
    ) -> asyncio.Queue[wire.DataChunk]:
        """Start collecting the chunks of request ``req``; ``senders``: the CURVE keys
        of the stages that may send them (None: any, in an open cluster)."""
        q: asyncio.Queue[wire.DataChunk] = asyncio.Queue(maxsize=MAX_QUEUED_CHUNKS)
        self._streams[req] = q
        if senders is not None:
            self._senders[req] = senders
        return q

    def close(self, req: str) -> None:
        """Stop collecting chunks of ``req``; later ones are dropped."""
        self._streams.pop(req, None)
        self._senders.pop(req, None)

    def in_flight(self) -> int:
        """Requests this node currently owns."""
        return len(self._streams)

    async def send(self, addr: wire.Addr, msg: wire.StageMessage, *frames: bytes) -> None:
        """Send one message (plus raw frames) to a runner's ROUTER. Never blocks long:
        a runner that is gone makes the DEALER queue, bounded by its HWM."""
        try:
            d = self._dealers.to(addr)
        except NoServerKey:
            self.counters.add("data", "not_member")  # trust refuses such a plan
            return
        await d.send_multipart([wire.encode(msg), *frames], flags=zmq.NOBLOCK)

    def drop_node(self, node: str) -> None:
        """Close the DEALERs to ``node`` (it is no member any more)."""
        self._dealers.drop_node(node)

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart(copy=False)
            try:
                self._on_frames(frames)
            except Exception:  # one bad frame must never stop every request's output
                log.exception("error handling a data-plane frame")
                self.counters.add("data", "error")

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            self.counters.add("data", "shape")
            return
        msg = decode_frame(frames[1].buffer, self._drop, wire.decode_output)
        if msg is None:
            return
        chunks = wire.chunks_in(msg)
        sender: bytes | None = None
        for c in chunks:
            q = self._streams.get(c.req)
            if q is None:
                self.counters.add("data", "unknown_request")
                continue
            senders = self._senders.get(c.req)
            if senders is not None:
                if sender is None:
                    sender = sender_key(frames[1])
                if sender not in senders:
                    self.counters.add("data", "foreign_sender")
                    continue
            try:
                q.put_nowait(c)
            except asyncio.QueueFull:
                self.counters.add("data", "queue_full")

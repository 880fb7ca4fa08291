"""The holder's side of weights over the mesh: a node that holds a model serves its
slices on its *weights ROUTER* (``weights_port`` in its card).

A :class:`~.wire.SliceAsk` is answered with the slice's manifest
(:class:`~.wire.SliceOffer`: size, chunk size, the sha256 of every chunk), once the
slice is cut and hashed (``prepare``, once per slice however many ask); a
:class:`~.wire.ChunkAsk` with the chunk's bytes. Chunks are read in a pool of
:data:`SERVE_THREADS` threads, so a fetch takes a bounded share of the holder's disk
and CPU and its inference keeps the rest. What a fetcher does with the offers (which
root it believes) is ``meshd.transport.transfer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from meshd.models.manifest import SLICE_FORMAT_VERSION, Manifest

from . import wire
from .security import CurveKeys, HandshakeReporter, sender_key, watch_handshakes
from .sockets import DATA, bind, open_socket
from .stats import DropCounters

__all__ = [
    "CORRUPT_ENV",
    "DELAY_ENV",
    "MAX_PREPARED",
    "SERVE_THREADS",
    "SliceUnavailable",
    "WeightServer",
]

log = logging.getLogger("meshd.transfer")

#: Chunks read at once by one holder, whoever asks: the share of its disk a fetch gets.
SERVE_THREADS = 2
#: Slices a holder keeps ready to serve (their manifests in memory).
MAX_PREPARED = 64
#: Test hook: the holder flips a byte in its first N chunks sent (a corrupted link).
CORRUPT_ENV = "MESHD_TEST_CORRUPT_CHUNKS"
#: Test hook: the holder waits this many seconds before each chunk (a slow link).
DELAY_ENV = "MESHD_TEST_SERVE_DELAY_S"


class SliceUnavailable(Exception):
    """A holder cannot offer a slice: ``code`` as in :class:`~.wire.SliceRefusal`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class WeightServer:
    """The holder's side: answers SliceAsk and ChunkAsk on its weights ROUTER.

    ``prepare`` (blocking, run in a thread) returns the file of a slice and its
    manifest, or raises :class:`SliceUnavailable`.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        prepare: Callable[[wire.SliceAsk], tuple[Path, Manifest]],
        bind_host: str = "0.0.0.0",
        keys: CurveKeys | None = None,
        counters: DropCounters | None = None,
        threads: int = SERVE_THREADS,
        admits: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.keys = keys
        #: Whether a sender's key is a member's now (None: anyone, an open cluster).
        self.admits = admits
        self.counters = counters or DropCounters()
        self.router = open_socket(ctx, zmq.ROUTER, DATA, keys, server=True)
        self.port = bind(self.router, bind_host)
        self._prepare = prepare
        self._prepared: OrderedDict[str, tuple[Path, Manifest]] = OrderedDict()
        self._preparing: dict[str, asyncio.Future[tuple[Path, Manifest]]] = {}
        #: What was asked (model, sha256, range) -> the id of the slice prepared for it.
        self._ids: dict[str, str] = {}
        self._pool = asyncio.Semaphore(threads)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._corrupt = int(os.environ.get(CORRUPT_ENV, "0") or 0)
        self._delay = float(os.environ.get(DELAY_ENV, "0") or 0)
        #: Bytes sent, for the holder's own log and metrics.
        self.sent = 0

    def start(self) -> None:
        """Start answering."""
        self._loop = asyncio.create_task(self._recv_loop(), name="weights-recv")
        if self.keys is not None:
            reporter = HandshakeReporter(self.counters.add)
            self._watch = asyncio.create_task(
                watch_handshakes(self.router, "weights", reporter), name="hs-weights"
            )

    async def stop(self) -> None:
        """Stop answering; close the socket."""
        for t in [self._loop, self._watch, *self._tasks]:
            if t is not None:
                t.cancel()
        for t in [self._loop, self._watch, *self._tasks]:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self.router.close(linger=0)

    async def _recv_loop(self) -> None:
        while True:
            raw = await self.router.recv_multipart(copy=False)
            if len(raw) != 2:
                self.counters.add("weights", "shape")
                continue
            if self.admits is not None and not self.admits(sender_key(raw[1])):
                self.counters.add("weights", "not_member")  # removed since it connected
                continue
            frames = [f.bytes for f in raw]
            try:
                msg = wire.decode_transfer(frames[1])
            except wire.FrameError as e:
                self.counters.add("weights", e.reason)
                continue
            if isinstance(msg, wire.SliceAsk):
                self._spawn(self._offer(frames[0], msg))
            elif isinstance(msg, wire.ChunkAsk):
                self._spawn(self._chunk(frames[0], msg))
            else:
                self.counters.add("weights", "unexpected")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _send(self, peer: bytes, msg: wire.TransferMessage, *raw: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a peer gone: nothing to tell
            await self.router.send_multipart([peer, wire.encode(msg), *raw], flags=zmq.NOBLOCK)

    async def _offer(self, peer: bytes, ask: wire.SliceAsk) -> None:
        try:
            if ask.version != SLICE_FORMAT_VERSION:
                raise SliceUnavailable(
                    "version",
                    f"slicing format {ask.version} asked, this node cuts {SLICE_FORMAT_VERSION}",
                )
            _path, m = await self._prepared_slice(ask)
        except SliceUnavailable as e:
            await self._send(peer, wire.SliceRefusal(slice="", code=e.code, message=str(e)))
            return
        except Exception as e:  # a holder's disk error is the asker's refusal, not a crash
            log.warning("weights: cannot prepare %s [%d, %d): %s", ask.model, ask.start, ask.end, e)
            await self._send(peer, wire.SliceRefusal(slice="", code="failed", message=str(e)))
            return
        await self._send(
            peer, wire.SliceOffer(slice=m.slice, size=m.size, chunk=m.chunk), m.digests
        )

    async def _prepared_slice(self, ask: wire.SliceAsk) -> tuple[Path, Manifest]:
        key = f"{ask.model}:{ask.sha256}:{ask.start}:{ask.end}"
        sid = self._ids.get(key)
        got = self._prepared.get(sid) if sid is not None else None
        if got is not None and got[0].exists():
            self._prepared.move_to_end(got[1].slice)
            return got
        fut = self._preparing.get(key)
        if fut is None:
            # One cut per slice however many fetchers ask at once.
            fut = asyncio.ensure_future(asyncio.to_thread(self._prepare, ask))
            self._preparing[key] = fut
            fut.add_done_callback(lambda _f: self._preparing.pop(key, None))
        path, m = await asyncio.shield(fut)
        self._prepared[m.slice] = (path, m)
        self._ids[key] = m.slice
        while len(self._prepared) > MAX_PREPARED:
            old, _ = self._prepared.popitem(last=False)
            self._ids = {k: v for k, v in self._ids.items() if v != old}
        return path, m

    async def _chunk(self, peer: bytes, ask: wire.ChunkAsk) -> None:
        got = self._prepared.get(ask.slice)
        if got is None:
            await self._send(
                peer,
                wire.SliceRefusal(
                    slice=ask.slice, code="unknown_slice", message="slice not prepared here"
                ),
            )
            return
        path, m = got
        if not 0 <= ask.index < m.count:
            self.counters.add("weights", "bad_index")
            return
        off, n = m.span(ask.index)
        async with self._pool:
            if self._delay > 0:  # inside the pool: the link, not each chunk, is slow
                await asyncio.sleep(self._delay)
            try:
                data = await asyncio.to_thread(_pread, path, off, n)
            except OSError as e:
                self._prepared.pop(ask.slice, None)
                await self._send(
                    peer, wire.SliceRefusal(slice=ask.slice, code="unknown_slice", message=str(e))
                )
                return
        if self._corrupt > 0:
            self._corrupt -= 1
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        self.sent += len(data)
        await self._send(peer, wire.ChunkData(slice=ask.slice, index=ask.index), data)


def _pread(path: Path, off: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)

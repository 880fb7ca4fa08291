"""Weights over the mesh: a holder serves slices, a fetcher pulls one from many holders.

Every node binds a *weights ROUTER* (``weights_port`` in its card). A node placed a
stage of a model it lacks fetches that stage's slice (``meshd.models.manifest``):

1. It sends :class:`~.wire.SliceAsk` to every holder; each cuts and hashes the slice
   (once, cached) and answers :class:`~.wire.SliceOffer` with the chunk digests.
   Every holder must offer the same manifest as the first one; one that does not is
   not used.
2. Chunks are pulled with credit-based flow control (the zguide's file-transfer
   pattern): each holder has at most :data:`WINDOW` :class:`~.wire.ChunkAsk` in flight,
   so several holders are pulled from at once and none is flooded.
3. Every chunk is checked against its digest before it is written to ``<dest>.part``;
   a bad one is dropped, counted and asked again (of another holder when one is left;
   a holder that sends :data:`MAX_CORRUPT` bad chunks is not asked again). A holder that
   goes silent for :data:`CHUNK_TIMEOUT_S` or leaves the cluster has its chunks asked
   of the others. Only when every chunk is verified is the file renamed to ``dest``.
4. A fetch that was cut short resumes: the chunks of ``<dest>.part`` that match the
   manifest kept in ``<dest>.part.manifest`` are not fetched again.

The holder reads chunks in a pool of :data:`SERVE_THREADS` threads, so a fetch takes
a bounded share of its disk and CPU and its inference keeps the rest. Both sockets are
CURVE-secured in a secured cluster (``open_socket``): only members reach a holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import shutil
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from meshd.models.manifest import (
    DIGEST_BYTES,
    SLICE_FORMAT_VERSION,
    Manifest,
    read_manifest,
    verified_chunks,
    write_manifest,
)

from . import wire
from .security import CurveKeys, HandshakeReporter, NoServerKey, sender_key, watch_handshakes
from .sockets import DATA, bind, endpoint, open_socket
from .stats import DropCounters

__all__ = [
    "CHUNK_TIMEOUT_S",
    "MAX_CORRUPT",
    "SERVE_THREADS",
    "WINDOW",
    "FetchError",
    "FetchProgress",
    "SliceUnavailable",
    "WeightServer",
    "fetch_slice",
]

log = logging.getLogger("meshd.transfer")

#: Chunk requests in flight per holder (the fetcher's credit towards it).
WINDOW = 8
#: Chunks read at once by one holder, whoever asks: the share of its disk a fetch gets.
SERVE_THREADS = 2
#: A holder that answers nothing for this long is taken for gone.
CHUNK_TIMEOUT_S = 10.0
#: Cutting and hashing a slice of a big model takes a while; an offer may take this long.
PREPARE_TIMEOUT_S = 600.0
#: Bad chunks after which a holder is not asked again in this fetch.
MAX_CORRUPT = 3
#: With no holder left, a fetch waits this long for one to (re)appear before failing.
NO_HOLDER_GRACE_S = 15.0
#: A fetch that verifies no chunk for this long fails (holders there but not serving).
STALL_TIMEOUT_S = 60.0
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


class FetchError(Exception):
    """A fetch ended without the slice: ``code`` is ``no_holder``, ``refused``,
    ``disk`` or ``stalled``; the message says why in words."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class FetchProgress:
    """Where a fetch stands (what the stage's status shows)."""

    done: int = 0
    total: int = 0
    #: Bytes per second over the fetch so far (resumed bytes not counted).
    rate: float = 0.0
    holders: int = 0
    corrupt: int = 0
    resumed: int = 0


# -- holder ----------------------------------------------------------------------------


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
        #: Whether a sender's key is a member's now (None: anyone; see :meth:`_recv_loop`).
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


# -- fetcher ---------------------------------------------------------------------------


@dataclass
class _Fetch:
    """The shared state of one fetch across its holders."""

    ask: wire.SliceAsk
    part: Path
    progress: FetchProgress
    on_progress: Callable[[FetchProgress], None]
    manifest: Manifest | None = None
    done: set[int] = field(default_factory=set)
    todo: deque[int] = field(default_factory=deque)
    #: Per chunk, the holders that sent it corrupted (asked of others first).
    spoiled: dict[int, set[str]] = field(default_factory=dict)
    begin: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Holders not asked again in this fetch, with why (refused, other bytes, corrupt).
    shunned: dict[str, str] = field(default_factory=dict)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    error: FetchError | None = None
    fetched: int = 0
    started: float = field(default_factory=time.monotonic)
    #: When the last chunk was verified (or the fetch began).
    moved: float = field(default_factory=time.monotonic)
    last_note: float = 0.0

    def note(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_note >= 0.25:
            self.last_note = now
            elapsed = max(1e-6, now - self.started)
            self.progress.rate = self.fetched / elapsed
            self.on_progress(self.progress)


async def fetch_slice(
    ctx: zmq.asyncio.Context,
    *,
    holders: Callable[[], list[wire.Addr]],
    ask: wire.SliceAsk,
    dest: Path,
    own_addresses: list[str],
    keys: CurveKeys | None = None,
    server_key: Callable[[str], bytes | None] = lambda node: None,
    on_progress: Callable[[FetchProgress], None] = lambda p: None,
    window: int = WINDOW,
    chunk_timeout: float = CHUNK_TIMEOUT_S,
    no_holder_grace: float = NO_HOLDER_GRACE_S,
    stall_timeout: float = STALL_TIMEOUT_S,
) -> Manifest:
    """Fetch the slice ``ask`` names from the nodes ``holders()`` returns (read again
    as the fetch goes: holders come and go) into ``dest``; its manifest once every
    byte is verified. Raises :class:`FetchError`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    f = _Fetch(ask=ask, part=part, progress=FetchProgress(), on_progress=on_progress)
    workers: dict[str, asyncio.Task[None]] = {}
    benched: dict[str, float] = {}  # holder -> when it may be asked again
    alone_since: float | None = None
    try:
        while not f.finished.is_set():
            now = time.monotonic()
            current = {a.node: a for a in holders()}
            for node, addr in current.items():
                if node not in workers and node not in f.shunned and benched.get(node, 0.0) <= now:
                    workers[node] = asyncio.create_task(
                        _pull(
                            ctx,
                            f,
                            addr,
                            own_addresses,
                            (keys, server_key(addr.node)),
                            window,
                            chunk_timeout,
                        ),
                        name=f"fetch-{node}",
                    )
            for node, t in list(workers.items()):
                if t.done():
                    del workers[node]
                    if not t.cancelled() and t.exception() is not None:
                        log.info("weights: pulling from %s failed: %r", node, t.exception())
                    # A holder that failed is tried again later (it may have been a
                    # blip), never at once: its chunks went to the others.
                    benched[node] = now + chunk_timeout
                elif node not in current:
                    t.cancel()  # left the cluster: its chunks go back to the others
            f.progress.holders = len(workers)
            if f.error is not None:
                raise f.error
            if workers:
                alone_since = None
            else:
                alone_since = alone_since or now
                if now - alone_since > no_holder_grace:
                    raise FetchError("no_holder", _why(f, "no node that holds the model answers"))
            if f.manifest is not None and now - f.moved > stall_timeout:
                raise FetchError("stalled", _why(f, f"no chunk arrived for {stall_timeout:.0f} s"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(f.finished.wait(), 0.5)
        if f.error is not None:
            raise f.error
    finally:
        for t in workers.values():
            t.cancel()
        for t in workers.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    assert f.manifest is not None
    try:
        os.replace(part, dest)
    except OSError as e:
        raise FetchError("disk", f"cannot keep the fetched slice: {e}") from e
    with contextlib.suppress(OSError):
        write_manifest(_manifest_file(dest), f.manifest)
        _manifest_file(part).unlink()
    f.note(force=True)
    return f.manifest


def _why(f: _Fetch, what: str) -> str:
    if f.shunned:
        what += "; " + "; ".join(f"{n}: {why}" for n, why in sorted(f.shunned.items()))
    if f.manifest is None:
        return what
    return f"{what} ({len(f.done)}/{f.manifest.count} chunks verified, kept to resume)"


def _manifest_file(path: Path) -> Path:
    return path.with_name(path.name + ".manifest")


async def _pull(
    ctx: zmq.asyncio.Context,
    f: _Fetch,
    addr: wire.Addr,
    own_addresses: list[str],
    keys: tuple[CurveKeys | None, bytes | None],
    window: int,
    chunk_timeout: float,
) -> None:
    """Pull chunks from one holder until none is left or it fails.

    A received chunk is hashed and written in a thread while the next ones arrive:
    the window counts chunks asked and chunks being checked, so neither the socket
    nor the disk waits for the other."""
    try:
        sock = open_socket(ctx, zmq.DEALER, DATA, keys[0], server=False, server_key=keys[1])
    except NoServerKey:
        log.warning("not fetching from %s: no member here", addr.node)
        return
    sock.connect(endpoint(addr, own_addresses))
    inflight: set[int] = set()
    checks: dict[asyncio.Future[bool], tuple[int, int]] = {}
    recv: asyncio.Future[list[zmq.Frame]] | None = None
    corrupt = 0
    try:
        m = await _offer_of(sock, f, addr)
        if m is None:
            return
        while not f.finished.is_set():
            while len(inflight) + len(checks) < window:
                i = _next_chunk(f, addr.node, inflight)
                if i is None:
                    break
                inflight.add(i)
                await sock.send_multipart(
                    [wire.encode(wire.ChunkAsk(slice=m.slice, index=i))], flags=zmq.NOBLOCK
                )
            if not inflight and not checks:
                # Nothing left to ask: the others hold the rest in flight; wait for
                # them to finish, or for one to give its chunks back.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(f.finished.wait(), 0.2)
                continue
            waiting: set[asyncio.Future[Any]] = set(checks)
            if inflight:
                recv = recv or asyncio.ensure_future(sock.recv_multipart(copy=False))
                waiting.add(recv)
            done, _ = await asyncio.wait(
                waiting, timeout=chunk_timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                raise TimeoutError
            for t in [t for t in checks if t.done()]:
                i, n = checks.pop(t)
                if t.result():
                    f.done.add(i)
                    f.moved = time.monotonic()
                    f.fetched += n
                    f.progress.done += n
                    f.note()
                    if len(f.done) == m.count:
                        f.finished.set()
                    continue
                corrupt += 1
                f.progress.corrupt += 1
                f.spoiled.setdefault(i, set()).add(addr.node)
                f.todo.appendleft(i)
                log.warning(
                    "weights: chunk %d of %s from %s failed its sha256 (%d from it): asked again",
                    i, m.slice[:12], addr.node, corrupt,
                )  # fmt: skip
                if corrupt >= MAX_CORRUPT:
                    f.shunned[addr.node] = f"{corrupt} chunks failed their sha256"
                    return
            if recv is None or not recv.done():
                continue
            frames, recv = recv.result(), None
            msg = _decoded(frames[0].bytes)
            if isinstance(msg, wire.SliceRefusal):
                if msg.code == "unknown_slice":  # evicted there: prepare it again
                    _give_back(f, inflight)
                    if await _offer_of(sock, f, addr) is None:
                        return
                    continue
                log.info("weights: %s refused: %s", addr.node, msg.message)
                f.shunned[addr.node] = msg.message
                return
            if not isinstance(msg, wire.ChunkData) or msg.slice != m.slice or len(frames) != 2:
                continue
            i = msg.index
            if i not in inflight or i in f.done:
                continue  # a late answer to a chunk given to another holder
            inflight.discard(i)
            data = frames[1].buffer
            check = asyncio.ensure_future(asyncio.to_thread(_check_and_write, f.part, m, i, data))
            checks[check] = (i, len(data))
    except TimeoutError:
        log.info("weights: %s sent nothing for %.0f s: its chunks go to the others",
                 addr.node, chunk_timeout)  # fmt: skip
    except OSError as e:
        f.error = FetchError("disk", f"cannot write the slice: {e}")
        f.finished.set()
    finally:
        if recv is not None:
            recv.cancel()
        if checks:  # a write in progress ends before the file may be renamed
            await asyncio.wait(list(checks))
            for t, (i, _n) in checks.items():
                if not t.cancelled() and t.exception() is None and t.result():
                    f.done.add(i)
                else:
                    inflight.add(i)
        _give_back(f, inflight)
        sock.close(linger=0)


def _give_back(f: _Fetch, inflight: set[int]) -> None:
    for i in sorted(inflight, reverse=True):
        if i not in f.done and i not in f.todo:
            f.todo.appendleft(i)
    inflight.clear()


def _next_chunk(f: _Fetch, node: str, inflight: set[int]) -> int | None:
    """The next chunk for ``node`` to send: the first one it did not spoil (a chunk it
    spoiled goes to it again only when no other holder is pulling)."""
    for _ in range(len(f.todo)):
        i = f.todo.popleft()
        if i in f.done or i in inflight:
            continue
        if node in f.spoiled.get(i, ()) and f.progress.holders > 1:
            f.todo.append(i)
            continue
        return i
    return None


def _check_and_write(part: Path, m: Manifest, i: int, data: bytes | memoryview) -> bool:
    off, n = m.span(i)
    if len(data) != n or hashlib.sha256(data).digest() != m.digest(i):
        return False
    fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)
    return True


def _decoded(frame: bytes) -> wire.TransferMessage | None:
    try:
        return wire.decode_transfer(frame)
    except wire.FrameError:
        return None


async def _offer_of(sock: zmq.asyncio.Socket, f: _Fetch, addr: wire.Addr) -> Manifest | None:
    """Ask ``addr`` for the slice; its manifest when it offers the same one as the
    others (the first offer of a fetch becomes the fetch's manifest), else None."""
    await sock.send_multipart([wire.encode(f.ask)], flags=zmq.NOBLOCK)
    deadline = time.monotonic() + PREPARE_TIMEOUT_S
    while True:
        frames = await asyncio.wait_for(
            sock.recv_multipart(), max(0.1, deadline - time.monotonic())
        )
        msg = _decoded(frames[0])
        if isinstance(msg, wire.SliceRefusal):
            log.info(
                "weights: %s cannot offer the slice (%s): %s", addr.node, msg.code, msg.message
            )
            f.shunned[addr.node] = msg.message
            if msg.code in ("version", "bad_range") and f.manifest is None:
                f.error = FetchError("refused", f"{addr.node}: {msg.message}")
                f.finished.set()
            return None
        if isinstance(msg, wire.SliceOffer) and len(frames) == 2:
            break
    m = Manifest(slice=msg.slice, size=msg.size, chunk=msg.chunk, digests=bytes(frames[1]))
    if not m.consistent() or len(m.digests) % DIGEST_BYTES:
        log.warning("weights: %s offered a malformed manifest", addr.node)
        f.shunned[addr.node] = "malformed manifest"
        return None
    async with f.begin:  # two holders' offers may arrive at once: one begins the fetch
        if f.manifest is None:
            await asyncio.to_thread(_begin, f, m)
            # Back on the loop: the event and the progress callback are not thread-safe.
            if len(f.done) == m.count:
                f.finished.set()
            f.note(force=True)
    assert f.manifest is not None
    if f.manifest.root != m.root or f.manifest.size != m.size:
        log.warning(
            "weights: %s offers other bytes for slice %s (root %s, expected %s): not used",
            addr.node, m.slice[:12], m.root[:12], f.manifest.root[:12],
        )  # fmt: skip
        f.shunned[addr.node] = f"offers other bytes (root {m.root[:12]})"
        return None
    return f.manifest


def _begin(f: _Fetch, m: Manifest) -> None:
    """Set the fetch's manifest; keep the verified chunks of a previous attempt (runs
    in a thread: touches files and plain fields only)."""
    if f.manifest is not None:
        return
    stored = read_manifest(_manifest_file(f.part))
    if stored is not None and stored.root == m.root and stored.size == m.size and f.part.exists():
        f.done = verified_chunks(f.part, m)
        f.progress.resumed = sum(m.span(i)[1] for i in f.done)
    else:
        with contextlib.suppress(FileNotFoundError):
            f.part.unlink()
        write_manifest(_manifest_file(f.part), m)
    need = m.size - f.progress.resumed
    free = shutil.disk_usage(f.part.parent).free
    if need > free:
        # Now, not after minutes of transfer: the stage fails typed and placement moves it.
        raise OSError(
            errno.ENOSPC, f"the slice needs {need / 1e6:.0f} MB, the disk has {free / 1e6:.0f} MB"
        )
    with open(f.part, "ab") as fh:  # the part file exists at its full size from now on
        fh.truncate(m.size)
    f.manifest = m
    f.todo = deque(i for i in range(m.count) if i not in f.done)
    f.progress.total = m.size
    f.progress.done = f.progress.resumed
    f.moved = time.monotonic()

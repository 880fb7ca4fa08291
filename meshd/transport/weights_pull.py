"""Pulling one fetch's chunks from one holder.

``meshd.transport.transfer.fetch_slice`` runs one :func:`pull` per holder. It casts the
holder's offer as a vote (``weights_state``) and pulls chunks only while the fetch takes
the root that holder offers. Chunks are pulled with credit-based flow control (the
zguide's file-transfer pattern): at most ``window`` :class:`~.wire.ChunkAsk` in flight
per holder, so several holders are pulled from at once and none is flooded. Every chunk
is checked against the taken root's digest before it is written to the part file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from meshd.models.manifest import Manifest

from . import wire
from .security import CurveKeys, NoServerKey
from .sockets import DATA, endpoint, open_socket
from .weights_state import FetchError, FetchState, adopted, decoded, offer_of

__all__ = ["CHUNK_TIMEOUT_S", "MAX_CORRUPT", "WINDOW", "pull"]

log = logging.getLogger("meshd.transfer")

#: Chunk requests in flight per holder (the fetcher's credit towards it).
WINDOW = 8
#: A holder that answers nothing for this long is taken for gone.
CHUNK_TIMEOUT_S = 10.0
#: Bad chunks after which a holder is not asked again in this fetch.
MAX_CORRUPT = 3


# -- chunks ----------------------------------------------------------------------------


async def pull(
    ctx: zmq.asyncio.Context,
    f: FetchState,
    addr: wire.Addr,
    own_addresses: list[str],
    keys: tuple[CurveKeys | None, bytes | None],
    window: int,
    chunk_timeout: float,
) -> None:
    """Vote with one holder's offer and pull chunks from it while the fetch takes its
    root, until none is left or it fails. ``keys``: this node's pair and the holder's
    CURVE key (the one that must answer)."""
    try:
        sock = open_socket(ctx, zmq.DEALER, DATA, keys[0], server=False, server_key=keys[1])
    except NoServerKey:
        f.counters.add("weights", "not_member")  # the cluster lists it: not for long
        return
    sock.connect(endpoint(addr, own_addresses))
    try:
        mine = await offer_of(sock, f, addr)
        while mine is not None and not f.finished.is_set():
            m = await adopted(f, addr.node, mine)
            if m is None:
                return
            f.pulling.add(addr.node)
            try:
                again = await _pull_chunks(sock, f, addr, m, window, chunk_timeout)
            finally:
                f.pulling.discard(addr.node)
            if again:  # evicted there: prepare it again
                mine = await offer_of(sock, f, addr)
    except TimeoutError:
        log.info("weights: %s sent nothing for %.0f s: its chunks go to the others",
                 addr.node, chunk_timeout)  # fmt: skip
    except OSError as e:
        f.fail(FetchError("disk", f"cannot write the slice: {e}"))
    finally:
        sock.close(linger=0)


async def _pull_chunks(
    sock: zmq.asyncio.Socket,
    f: FetchState,
    addr: wire.Addr,
    m: Manifest,
    window: int,
    chunk_timeout: float,
) -> bool:
    """Pull chunks of ``m`` until none is left, the root taken changes or the holder
    fails; True when the holder lost the slice and must be asked for it again.

    A received chunk is hashed and written in a thread while the next ones arrive:
    the window counts chunks asked and chunks being checked, so neither the socket
    nor the disk waits for the other."""
    epoch = f.epoch
    inflight: set[int] = set()
    checks: dict[asyncio.Future[bool], tuple[int, int]] = {}
    recv: asyncio.Future[list[zmq.Frame]] | None = None
    try:
        while not f.finished.is_set() and f.epoch == epoch:
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
            if not _checked(f, addr.node, m, checks, epoch):
                return False
            if recv is None or not recv.done():
                continue
            frames, recv = recv.result(), None
            msg = decoded(frames[0].bytes)
            if isinstance(msg, wire.SliceRefusal):
                if msg.code == "unknown_slice":
                    return True
                log.info("weights: %s refused: %s", addr.node, msg.message)
                f.shunned[addr.node] = msg.message
                return False
            if not isinstance(msg, wire.ChunkData) or msg.slice != m.slice or len(frames) != 2:
                continue
            i = msg.index
            if i not in inflight or i in f.done:
                continue  # a late answer to a chunk given to another holder
            inflight.discard(i)
            data = frames[1].buffer
            check = asyncio.ensure_future(asyncio.to_thread(_check_and_write, f.part, m, i, data))
            checks[check] = (i, len(data))
        return False
    finally:
        if recv is not None:
            recv.cancel()
        await _settle_checks(f, m, checks, inflight, epoch)


async def _settle_checks(
    f: FetchState,
    m: Manifest,
    checks: dict[asyncio.Future[bool], tuple[int, int]],
    inflight: set[int],
    epoch: int,
) -> None:
    """A write in progress ends before the file may be renamed; what did not arrive
    goes back to the others (unless the root taken changed meanwhile)."""
    if checks:
        await asyncio.wait(list(checks))
        for t, (i, _n) in checks.items():
            ok = not t.cancelled() and t.exception() is None and t.result()
            if ok and f.epoch == epoch:
                f.done.add(i)
            else:
                inflight.add(i)
        if f.epoch == epoch and len(f.done) == m.count:
            f.finished.set()
    if f.epoch == epoch:
        _give_back(f, inflight)
    inflight.clear()


def _checked(
    f: FetchState,
    node: str,
    m: Manifest,
    checks: dict[asyncio.Future[bool], tuple[int, int]],
    epoch: int,
) -> bool:
    """Count the chunks whose check ended; False when ``node`` sent too many bad ones."""
    for t in [t for t in checks if t.done()]:
        i, n = checks.pop(t)
        ok = t.result()  # an OSError (disk) ends the pull: the fetch fails typed
        if f.epoch != epoch:
            continue  # checked against a root no longer taken
        if ok:
            f.done.add(i)
            f.moved = time.monotonic()
            f.fetched += n
            f.progress.done += n
            f.note()
            if len(f.done) == m.count:
                f.finished.set()
            continue
        corrupt = f.corrupt_by[node] = f.corrupt_by.get(node, 0) + 1
        f.progress.corrupt += 1
        f.spoiled.setdefault(i, set()).add(node)
        f.todo.appendleft(i)
        log.warning(
            "weights: chunk %d of %s from %s failed its sha256 (%d from it): asked again",
            i, m.slice[:12], node, corrupt,
        )  # fmt: skip
        if corrupt >= MAX_CORRUPT:
            f.shunned[node] = f"{corrupt} chunks failed their sha256"
            return False
    return True


def _give_back(f: FetchState, inflight: set[int]) -> None:
    for i in sorted(inflight, reverse=True):
        if i not in f.done and i not in f.todo:
            f.todo.appendleft(i)


def _next_chunk(f: FetchState, node: str, inflight: set[int]) -> int | None:
    """The next chunk for ``node`` to send: the first one it did not spoil (a chunk it
    spoiled goes to it again only when no other holder is pulling)."""
    for _ in range(len(f.todo)):
        i = f.todo.popleft()
        if i in f.done or i in inflight:
            continue
        if node in f.spoiled.get(i, ()) and len(f.pulling) > 1:
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

"""One fetch's shared state, and which root it takes.

``meshd.transport.transfer.fetch_slice`` keeps one :class:`FetchState` for a fetch;
each holder's pull (``weights_pull``) asks its holder for the slice and casts the
holder's offer as a vote (``weights_votes``). :func:`settle` counts the votes and takes
the root they name: the fetch's manifest, every chunk checked against it. A holder that
offers another root waits for the vote to turn (:func:`adopted`): it is counted and
logged, not shunned.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio

from meshd.models.manifest import (
    DIGEST_BYTES,
    Manifest,
    read_manifest,
    verified_chunks,
    write_manifest,
)

from . import wire
from .stats import DropCounters
from .weights_votes import Offer, Votes

__all__ = [
    "OFFER_WAIT_S",
    "PREPARE_TIMEOUT_S",
    "FetchError",
    "FetchProgress",
    "FetchState",
    "adopted",
    "decoded",
    "key",
    "leads",
    "manifest_file",
    "offer_of",
    "reset",
    "settle",
]

log = logging.getLogger("meshd.transfer")

#: Cutting and hashing a slice of a big model takes a while; an offer may take this long.
PREPARE_TIMEOUT_S = 600.0
#: Without a majority, the holders that offered within this long of the first decide.
OFFER_WAIT_S = 60.0


class FetchError(Exception):
    """A fetch ended without the slice: ``code`` is ``no_holder``, ``refused``,
    ``disagree`` (holders offer different bytes and none leads), ``disk`` or
    ``stalled``; the message says why in words."""

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
    #: Holders whose offer disagreed with the root taken (their bytes not used).
    dissent: int = 0
    #: Assembled slices that failed the check before loading (deleted, fetched again).
    rejected: int = 0


def key(m: Manifest) -> Offer:
    """What two holders' offers must share to be the same bytes."""
    return (m.root, m.size, m.chunk)


@dataclass
class FetchState:
    """The shared state of one fetch across its holders."""

    ask: wire.SliceAsk
    part: Path
    progress: FetchProgress
    on_progress: Callable[[FetchProgress], None]
    votes: Votes
    counters: DropCounters
    #: The manifest of the root taken (None: not yet, or dropped to start over).
    manifest: Manifest | None = None
    #: Bumped whenever the root taken changes: results of an older one are dropped.
    epoch: int = 0
    #: The root changed while pulls ran: a write checked against the old one may land
    #: after the new one's, so the part file is read again before it is kept.
    switched: bool = False
    #: Each holder's offer, and the holders the cluster lists now.
    offers: dict[str, Manifest] = field(default_factory=dict)
    listed: set[str] = field(default_factory=set)
    #: Holders pulling chunks of the taken root now.
    pulling: set[str] = field(default_factory=set)
    dissenters: set[str] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    todo: deque[int] = field(default_factory=deque)
    #: Per chunk, the holders that sent it corrupted (asked of others first).
    spoiled: dict[int, set[str]] = field(default_factory=dict)
    corrupt_by: dict[str, int] = field(default_factory=dict)
    begin: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Pulsed when the root taken changes.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Holders not asked again in this fetch, with why (refused, corrupt, failed check).
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

    def fail(self, error: FetchError) -> None:
        if self.error is None:
            self.error = error
        self.finished.set()


# -- which root ------------------------------------------------------------------------


async def settle(f: FetchState) -> None:
    """Count the votes; take the root they name (starting over when it is another
    than the one taken), or, while the count is open, the one offered most so far;
    fail the fetch on a tie."""
    async with f.begin:
        v = f.votes.decide(f.listed, time.monotonic())
        if v.tie:
            f.fail(FetchError("disagree", f"the holders offer different bytes: {v.tie}"))
            return
        target = v.offer
        if target is None and f.manifest is None:
            # The count is open: pull the root offered most so far meanwhile (kept only
            # if the count names it), so holders still cutting do not hold the fetch up.
            target = f.votes.front()
        if target is None or (f.manifest is not None and key(f.manifest) == target):
            return
        m = f.offers[f.votes.backers(target)[0]]
        if f.manifest is not None:
            log.warning(
                "weights: %s offer root %s for slice %s, more holders than root %s had: "
                "the fetch starts over with it",
                ", ".join(f.votes.backers(target)), m.root[:12], m.slice[:12],
                f.manifest.root[:12],
            )  # fmt: skip
            reset(f)
            f.switched = True
        try:
            await asyncio.to_thread(_begin, f, m)
        except OSError as e:
            f.fail(FetchError("disk", f"cannot write the slice: {e}"))
            return
        # Back on the loop: the events and the progress callback are not thread-safe.
        if len(f.done) == m.count:
            f.finished.set()
        f.note(force=True)
        f.changed.set()
        f.changed.clear()


def reset(f: FetchState) -> None:
    """Drop the root taken and every chunk verified against it."""
    f.manifest = None
    f.epoch += 1
    f.done, f.todo, f.spoiled = set(), deque(), {}
    f.progress.done = f.progress.total = f.progress.resumed = 0
    f.finished.clear()


def _begin(f: FetchState, m: Manifest) -> None:
    """Take ``m``; keep the verified chunks of a previous attempt at the same root
    (runs in a thread: touches files and plain fields only)."""
    stored = read_manifest(manifest_file(f.part))
    if stored is not None and key(stored) == key(m) and f.part.exists():
        f.done = verified_chunks(f.part, m)
        f.progress.resumed = sum(m.span(i)[1] for i in f.done)
    else:
        with contextlib.suppress(FileNotFoundError):
            f.part.unlink()
        write_manifest(manifest_file(f.part), m)
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


def manifest_file(path: Path) -> Path:
    return path.with_name(path.name + ".manifest")


async def offer_of(sock: zmq.asyncio.Socket, f: FetchState, addr: wire.Addr) -> Manifest | None:
    """Ask ``addr`` for the slice and cast its offer as a vote; the manifest it offers,
    or None when it refuses or offers a malformed one."""
    await sock.send_multipart([wire.encode(f.ask)], flags=zmq.NOBLOCK)
    deadline = time.monotonic() + PREPARE_TIMEOUT_S
    while True:
        frames = await asyncio.wait_for(
            sock.recv_multipart(), max(0.1, deadline - time.monotonic())
        )
        msg = decoded(frames[0])
        if isinstance(msg, wire.SliceRefusal):
            log.info(
                "weights: %s cannot offer the slice (%s): %s", addr.node, msg.code, msg.message
            )
            f.shunned[addr.node] = msg.message
            f.votes.refusal(addr.node)
            if msg.code in ("version", "bad_range") and f.manifest is None:
                f.fail(FetchError("refused", f"{addr.node}: {msg.message}"))
            return None
        if isinstance(msg, wire.SliceOffer) and len(frames) == 2:
            break
    m = Manifest(slice=msg.slice, size=msg.size, chunk=msg.chunk, digests=bytes(frames[1]))
    if not m.consistent() or len(m.digests) % DIGEST_BYTES:
        log.warning("weights: %s offered a malformed manifest", addr.node)
        f.shunned[addr.node] = "malformed manifest"
        f.votes.refusal(addr.node)
        return None
    f.offers[addr.node] = m
    f.votes.offered(addr.node, key(m), time.monotonic())
    await settle(f)
    return m


def leads(f: FetchState, m: Manifest) -> bool:
    """Whether the count names ``m``'s root now."""
    return f.votes.decide(f.listed, time.monotonic()).offer == key(m)


async def adopted(f: FetchState, node: str, mine: Manifest) -> Manifest | None:
    """Wait until the fetch takes the root ``node`` offered (``mine``); None when the
    fetch ends first or ``node`` is no longer asked."""
    while not f.finished.is_set() and node not in f.shunned and node not in f.votes.distrusted:
        m = f.manifest
        if m is not None and key(m) == key(mine):
            return m
        if m is not None and node not in f.dissenters and leads(f, m):
            # Counted and said once, when the root taken leads the count (an honest
            # holder answering late is not counted against a liar's root it is about to
            # outvote); the holder is not shunned: the vote may still turn.
            f.dissenters.add(node)
            f.progress.dissent += 1
            f.counters.add("weights", "other_root")
            backers = f.votes.backers(key(m))
            log.warning(
                "weights: %s offers other bytes for slice %s (root %s; %s offer %s): not used",
                node, m.slice[:12], mine.root[:12], ", ".join(backers) or "none", m.root[:12],
            )  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(f.changed.wait(), 0.2)
    return None


def decoded(frame: bytes) -> wire.TransferMessage | None:
    try:
        return wire.decode_transfer(frame)
    except wire.FrameError:
        return None

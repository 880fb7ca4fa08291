"""Weights over the mesh: a holder serves slices, a fetcher pulls one from many holders.

Every node binds a *weights ROUTER* (``weights_port`` in its card; ``weights_server``).
A node placed a stage of a model it lacks fetches that stage's slice
(``meshd.models.manifest``):

1. It sends :class:`~.wire.SliceAsk` to every holder the cluster lists (the live nodes
   whose card names the model with the placed sha256); each cuts and hashes the slice
   (once, cached) and answers :class:`~.wire.SliceOffer` with the chunk digests.
2. The offers are votes (``weights_votes``): the slice is kept only under the root
   (the sha256 of the digests) that a majority of the holders offer, or, once all have
   answered or :data:`OFFER_WAIT_S` has passed, the one more of them offer than any
   other. Slicing is deterministic, so honest holders of the placed file offer the same
   root. While the count is open, the root offered most so far is pulled (a slow holder
   does not hold the fetch up); a count that names another root starts the fetch over.
   A holder that offers another root than the one named is logged and counted and its
   bytes are not used, but it is not shunned (the vote may turn its way). A tie among
   holders that have all answered fails the fetch (``disagree``): nothing tells honest
   from lying then.
3. Chunks are pulled with credit-based flow control from every holder of the root
   taken (``weights_pull``), each checked against its digest before it is written to
   ``<dest>.part``; a bad one is dropped, counted and asked again (of another holder
   when one is left; a holder that sends :data:`MAX_CORRUPT` bad chunks is not asked
   again). A holder that goes silent for :data:`CHUNK_TIMEOUT_S` or leaves the
   cluster has its chunks asked of the others.
4. Before the file is renamed to ``dest`` (and so before any runner loads it), the
   count must name its root (every chunk in the file was checked against that root
   before it was written; after a switch of roots the file is read again and checked
   whole), then ``verify`` (the caller's check against the model's own facts) runs. A slice that
   fails it is deleted, the holders that offered its root lose their vote and are not
   asked again, and the fetch starts over with the others.
5. A fetch that was cut short resumes: the chunks of ``<dest>.part`` that match the
   manifest kept in ``<dest>.part.manifest`` are not fetched again (when the root
   taken is the same).

Both sockets are CURVE-secured in a secured cluster (``open_socket``): only members
reach a holder. Membership does not make a holder honest; the vote and ``verify`` are
what a fetch relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import zmq.asyncio

from meshd.models.manifest import Manifest, verified_chunks, write_manifest

from . import wire
from .security import CurveKeys
from .stats import DropCounters
from .weights_pull import CHUNK_TIMEOUT_S, MAX_CORRUPT, WINDOW, pull
from .weights_server import CORRUPT_ENV, DELAY_ENV, SERVE_THREADS, SliceUnavailable, WeightServer
from .weights_state import (
    OFFER_WAIT_S,
    FetchError,
    FetchProgress,
    FetchState,
    key,
    leads,
    manifest_file,
    reset,
    settle,
)
from .weights_votes import Votes

__all__ = [
    "CHUNK_TIMEOUT_S",
    "CORRUPT_ENV",
    "DELAY_ENV",
    "MAX_CORRUPT",
    "OFFER_WAIT_S",
    "SERVE_THREADS",
    "WINDOW",
    "FetchError",
    "FetchProgress",
    "SliceRejected",
    "SliceUnavailable",
    "WeightServer",
    "fetch_slice",
]

log = logging.getLogger("meshd.transfer")

#: With no holder left, a fetch waits this long for one to (re)appear before failing.
NO_HOLDER_GRACE_S = 15.0
#: A fetch that verifies no chunk for this long fails (holders there but not serving).
STALL_TIMEOUT_S = 60.0


class SliceRejected(Exception):
    """Raised by a fetch's ``verify``: the assembled slice is not the model's (the
    message says what differs)."""


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
    offer_wait: float = OFFER_WAIT_S,
    verify: Callable[[Path, Manifest], None] | None = None,
    counters: DropCounters | None = None,
) -> Manifest:
    """Fetch the slice ``ask`` names from the nodes ``holders()`` returns (read again
    as the fetch goes: holders come and go) into ``dest``; its manifest once every
    byte is verified against the root the holders agree on and ``verify`` (blocking,
    run in a thread; raises :class:`SliceRejected`) passed. Raises :class:`FetchError`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    f = FetchState(
        ask=ask, part=dest.with_name(dest.name + ".part"), progress=FetchProgress(),
        on_progress=on_progress,
        votes=Votes(wait=offer_wait), counters=counters or DropCounters(),
    )  # fmt: skip
    workers: dict[str, asyncio.Task[None]] = {}
    benched: dict[str, float] = {}  # holder -> when it may be asked again
    alone_since: float | None = None
    try:
        while True:
            now = time.monotonic()
            current = {a.node: a for a in holders()}
            f.listed = set(current)
            for node, addr in current.items():
                if node not in workers and node not in f.shunned and benched.get(node, 0.0) <= now:
                    keyring = (keys, server_key(node))
                    workers[node] = asyncio.create_task(
                        pull(ctx, f, addr, own_addresses, keyring, window, chunk_timeout),
                        name=f"fetch-{node}",
                    )
            _reap(workers, benched, current, now + chunk_timeout)
            f.progress.holders = len(workers)
            await settle(f)  # the wait for slow holders may have run out
            if f.error is not None:
                raise f.error
            if workers:
                alone_since = None
            else:
                alone_since = alone_since or now
                if now - alone_since > no_holder_grace:
                    raise FetchError("no_holder", _why(f, "no node that holds the model answers"))
            if f.manifest is not None and now - f.moved > stall_timeout:
                raise _stalled(f, stall_timeout)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(f.finished.wait(), 0.5)
            if f.finished.is_set() and f.error is None:
                if f.manifest is None or not leads(f, f.manifest):
                    # The bytes were pulled while the count was open: not renamed until
                    # it names their root (or another: the fetch starts over; a stall
                    # ends the wait).
                    await asyncio.sleep(0.5)
                    continue
                # Every chunk arrived: the pulls end, the whole is checked; on a
                # failure the holders left are asked again at the next turn.
                await _stop(workers)
                benched.clear()
                if await _whole(f, verify):
                    break
    finally:
        await _stop(workers)
    return _keep(f, dest)


def _stalled(f: FetchState, stall_timeout: float) -> FetchError:
    if f.finished.is_set():  # every chunk here, held for the count
        return FetchError("disagree", _why(f, "the holders' offers do not name the bytes' root"))
    return FetchError("stalled", _why(f, f"no chunk arrived for {stall_timeout:.0f} s"))


def _keep(f: FetchState, dest: Path) -> Manifest:
    """Rename the checked part file into place, its manifest beside it."""
    m = f.manifest
    assert m is not None
    try:
        os.replace(f.part, dest)
    except OSError as e:
        raise FetchError("disk", f"cannot keep the fetched slice: {e}") from e
    with contextlib.suppress(OSError):
        write_manifest(manifest_file(dest), m)
        manifest_file(f.part).unlink()
    f.note(force=True)
    return m


def _reap(
    workers: dict[str, asyncio.Task[None]],
    benched: dict[str, float],
    current: dict[str, wire.Addr],
    until: float,
) -> None:
    """Forget the pulls that ended; stop those of holders that left the cluster."""
    for node, t in list(workers.items()):
        if t.done():
            del workers[node]
            if not t.cancelled() and t.exception() is not None:
                log.info("weights: pulling from %s failed: %r", node, t.exception())
            # A holder that failed is tried again later (it may have been a blip),
            # never at once: its chunks went to the others.
            benched[node] = until
        elif node not in current:
            t.cancel()  # left the cluster: its chunks go back to the others


async def _stop(workers: dict[str, asyncio.Task[None]]) -> None:
    for t in workers.values():
        t.cancel()
    for t in workers.values():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    workers.clear()


async def _whole(f: FetchState, verify: Callable[[Path, Manifest], None] | None) -> bool:
    """Check the assembled slice before it may be loaded: its chunks against the root
    the count names, then ``verify``. False when the fetch must go on: chunks that do
    not hold their bytes are fetched again; a slice ``verify`` rejects is deleted, its
    root's holders lose their vote, and the fetch starts over with the others.

    Every chunk was checked against that root before this process wrote it, and
    nothing else writes the part file, so it is read again only after a switch of
    roots (a write checked against the old root may have landed late): a second read
    of a big slice costs seconds of disk and CPU."""
    m = f.manifest
    assert m is not None
    good = await asyncio.to_thread(verified_chunks, f.part, m) if f.switched else f.done
    f.switched = False
    if len(good) < m.count:
        log.warning(
            "weights: %d chunks of slice %s did not hold their bytes once assembled: "
            "fetched again", m.count - len(good), m.slice[:12],
        )  # fmt: skip
        f.done = good
        f.todo = deque(i for i in range(m.count) if i not in good)
        f.progress.done = sum(m.span(i)[1] for i in good)
        f.finished.clear()
        return False
    if verify is None:
        return True
    try:
        await asyncio.to_thread(verify, f.part, m)
    except SliceRejected as e:
        nodes = f.votes.distrust(key(m), str(e))
        for n in nodes:
            f.shunned[n] = f"its slice failed the check before loading: {e}"
        f.progress.rejected += 1
        f.counters.add("weights", "rejected")
        log.warning(
            "weights: slice %s (root %s, offered by %s) failed the check before loading: "
            "%s; deleted, fetched again from the other holders",
            m.slice[:12], m.root[:12], ", ".join(nodes), e,
        )  # fmt: skip
        async with f.begin:
            reset(f)
        for p in (f.part, manifest_file(f.part)):
            p.unlink(missing_ok=True)
        return False
    return True


def _why(f: FetchState, what: str) -> str:
    if f.shunned:
        what += "; " + "; ".join(f"{n}: {why}" for n, why in sorted(f.shunned.items()))
    if f.manifest is None:
        return what
    return f"{what} ({len(f.done)}/{f.manifest.count} chunks verified, kept to resume)"

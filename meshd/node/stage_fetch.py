"""A stage's slice fetched from the nodes that hold its model, for a node that lacks
the file: first a live holder waited for (a node that just joined may know the plan a
few heartbeats before it hears the holder's card), then the fetch, its progress kept on
the stage's :class:`RunnerProc` for the heartbeat, its failure as the stage's reason."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from meshd.crdt.views import Instance

from .cluster import FETCH_FAILED, MODEL_MISSING
from .runner_procs import RunnerProc, public_reason

__all__ = ["FETCH_BEAT_S", "HOLDER_WAIT_S", "Fetch", "await_holder", "fetch_stage_slice"]

log = logging.getLogger("meshd.supervisor")

#: ``fetch(instance, stage index, destination, on_progress)``: the stage's slice from
#: the nodes that hold the model, verified, at the destination (raises when it cannot).
Fetch = Callable[[Instance, int, Path, Callable[[int, int, float], None]], Awaitable[object]]
#: Fetch progress is pushed into the heartbeat at most this often.
FETCH_BEAT_S = 1.0
#: How long a stage whose model is not here waits for a live node that serves its
#: slices before it is reported ``model not available here``: giving up at once, before
#: the holder's card arrived, would move the stage away from this node for good.
HOLDER_WAIT_S = 5.0


async def await_holder(r: RunnerProc, fetchable: Callable[[], bool]) -> bool:
    """Whether ``fetchable()`` says a live node serves ``r``'s slice within
    :data:`HOLDER_WAIT_S` (False at once when the stage is stopped meanwhile)."""
    until = time.monotonic() + HOLDER_WAIT_S
    while not fetchable():
        if r.state == "stopped" or time.monotonic() >= until:
            return False
        await asyncio.sleep(0.2)
    return r.state != "stopped"


async def fetch_stage_slice(
    r: RunnerProc,
    inst: Instance,
    i: int,
    fetch: Fetch,
    fetchable: Callable[[Instance], bool],
    on_status: Callable[[], None],
) -> bool:
    """Fetch stage ``i`` of ``inst``'s slice to ``r``'s model path; True once it is
    there to load. Else ``r`` is failed with the reason (no holder: ``model not
    available here``; a fetch that failed: ``fetch failed: ...``), or was stopped."""
    beat = 0.0

    def progress(done: int, total: int, rate: float) -> None:
        nonlocal beat
        r.fetched, r.fetch_total, r.fetch_rate = done, total, rate
        now = time.monotonic()
        if now - beat >= FETCH_BEAT_S:
            beat = now
            on_status()

    if not await await_holder(r, lambda: fetchable(inst)):
        if r.state != "stopped":
            log.info("stage %s/%d: no live node serves its slices", inst.id, i)
            r.state, r.reason = "failed", MODEL_MISSING
            on_status()
        return False
    t0 = time.monotonic()
    log.info("stage %s/%d: fetching its slice [%d, %d) from the nodes that hold %s",
             inst.id, i, r.key.start, r.key.end, inst.spec.model)  # fmt: skip
    try:
        await fetch(inst, i, Path(r.config.model_path), progress)
    except Exception as e:
        if r.state != "stopped":
            r.state, r.reason = "failed", f"{FETCH_FAILED}: {public_reason(str(e))}"
            log.warning("stage %s/%d: %s", inst.id, i, r.reason)
            on_status()
        return False
    log.info(
        "stage %s/%d: slice fetched, %d bytes in %.1f s",
        inst.id, i, r.fetch_total, time.monotonic() - t0,
    )  # fmt: skip
    return True

"""Stalled runners: a runner that is alive but makes no progress is found within
seconds, so its requests replay instead of waiting out the chunk timeout.

A runner beats every :data:`~meshd.engines.protocol.BEAT_S` from a thread of its own
(``meshd.engines.runner.heart``), saying how long the step under way has run and how
long its measured decode speed says it should take. It has stalled when its beats stop
for :data:`SILENCE_S` (the process is stopped: SIGSTOP, a laptop swapping to a halt) or
one step runs past :data:`STEP_FACTOR` times its prediction and :data:`STEP_MIN_S` (the
engine hangs: a wedged GPU driver). A busy machine slows every step alike, and beats
still come: that is no stall.

The node's event loop can itself be late (its machine as busy as the runner's); a
check that wakes more than :data:`LAG_S` late starts the silence over rather than
blame the runner for the node's own pause.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from meshd.engines.protocol import BEAT_S

__all__ = ["LAG_S", "SILENCE_S", "STALLED", "STEP_FACTOR", "STEP_MIN_S", "stall", "watch"]

#: How a stalled runner's reason starts (it travels in the heartbeat).
STALLED = "stalled"
SILENCE_S = 2.0
STEP_MIN_S = 10.0
STEP_FACTOR = 20.0
LAG_S = 1.0


class Beating(Protocol):
    """What the watch reads of a runner (``RunnerProc``)."""

    state: str
    last_beat: float
    step_s: float
    expect_s: float


def stall(now: float, last_beat: float, step_s: float, expect_s: float) -> str | None:
    """Why a ready runner whose last beat came at ``last_beat`` (saying ``step_s`` and
    ``expect_s``) has stalled by ``now`` (monotonic seconds), or None: it has not."""
    quiet = now - last_beat
    if quiet > SILENCE_S:
        return f"{STALLED}: no sign of life for {quiet:.1f} s"
    if step_s > max(STEP_MIN_S, STEP_FACTOR * expect_s):
        return (
            f"{STALLED}: one engine step has run {step_s:.0f} s "
            f"(its measured speed says {expect_s:.1f} s)"
        )
    return None


async def watch(r: Beating, on_stall: Callable[[str], None], every: float = BEAT_S) -> None:
    """Check ``r`` every ``every`` seconds while it is ready; call ``on_stall`` with the
    reason once it stalls (then stop: the caller ends the runner)."""
    due = time.monotonic() + every
    while True:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        now = time.monotonic()
        if now - due > LAG_S:
            r.last_beat = now  # the node paused, not (for all it knows) the runner
        due = now + every
        if r.state != "ready":
            continue
        why = stall(now, r.last_beat, r.step_s, r.expect_s)
        if why is not None:
            on_stall(why)
            return

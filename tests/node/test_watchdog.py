"""The stall judgement (``meshd.node.watchdog``), as a pure thing, and its watch on a
runner that beats, pauses and stops."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from meshd.node.watchdog import LAG_S, SILENCE_S, STEP_FACTOR, STEP_MIN_S, stall, watch


def test_silence_or_a_step_far_past_its_prediction_is_a_stall_a_slow_step_is_not() -> None:
    assert stall(10.0, last_beat=10.0 - SILENCE_S + 0.1, step_s=0.0, expect_s=0.0) is None
    why = stall(10.0, last_beat=10.0 - SILENCE_S - 0.5, step_s=0.0, expect_s=0.0)
    assert why is not None and why.startswith("stalled: no sign of life for 2.5 s")
    # A long prefill on a slow machine: long, but within its prediction's margin.
    assert stall(10.0, 10.0, step_s=STEP_MIN_S + 5, expect_s=1.0) is None
    why = stall(10.0, 10.0, step_s=STEP_FACTOR * 2.0 + 1, expect_s=2.0)
    assert why is not None and "one engine step has run 41 s" in why
    # Unmeasured speed: the floor alone.
    assert stall(10.0, 10.0, step_s=STEP_MIN_S + 1, expect_s=0.0) is not None


@dataclass
class _Runner:
    state: str = "ready"
    last_beat: float = 0.0
    step_s: float = 0.0
    expect_s: float = 0.0


async def test_the_watch_calls_a_runner_whose_beats_stop_stalled_once() -> None:
    r = _Runner(last_beat=time.monotonic())
    stalls: list[str] = []
    beating = True

    async def beat() -> None:
        while beating:
            r.last_beat = time.monotonic()
            await asyncio.sleep(0.05)

    b = asyncio.create_task(beat())
    w = asyncio.create_task(watch(r, stalls.append, every=0.05))
    await asyncio.sleep(SILENCE_S + 0.5)
    assert stalls == [] and not w.done()  # beating: fine
    beating = False
    await b
    await asyncio.wait_for(w, SILENCE_S + 2)
    assert len(stalls) == 1 and "no sign of life" in stalls[0]
    assert SILENCE_S <= time.monotonic() - r.last_beat < SILENCE_S + 1


async def test_a_node_that_paused_itself_does_not_blame_its_runner() -> None:
    r = _Runner(last_beat=time.monotonic())
    stalls: list[str] = []
    w = asyncio.create_task(watch(r, stalls.append, every=0.05))
    await asyncio.sleep(0.1)
    time.sleep(SILENCE_S + LAG_S)  # the node's own loop stops: no beat could be read
    await asyncio.sleep(0.2)
    assert stalls == [], stalls
    w.cancel()


@pytest.mark.parametrize("state", ["loading", "failed"])
async def test_only_a_ready_runner_is_watched(state: str) -> None:
    r = _Runner(state=state, last_beat=0.0)
    stalls: list[str] = []
    w = asyncio.create_task(watch(r, stalls.append, every=0.01))
    await asyncio.sleep(0.1)
    assert stalls == [] and not w.done()
    w.cancel()

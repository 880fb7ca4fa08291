"""A stage times its decode steps: right after it loads (a scratch sequence, freed
after) and then on the steps it runs, for placement's speed figure."""

from __future__ import annotations

import time

import numpy as np
import pytest

from meshd.engines.calibrate import LayerClock, calibrate
from meshd.engines.llama_stage import LlamaStage
from meshd.engines.stage import StageInput
from meshd.models.resolve import DEFAULT_MODEL, resolve_model
from meshd.node.supervisor import RunnerProc, StageKey, decode_bps

pytestmark = pytest.mark.timeout(120)


def test_a_loaded_stage_times_a_decode_step_and_leaves_its_sequence_free() -> None:
    path = resolve_model(DEFAULT_MODEL).path
    with LlamaStage(path, first=True, last=True, n_ctx=256, n_seq_max=2) as stage:
        ms = calibrate(stage, 30)
        # 30 layers of a 135M model on a CPU: well under a millisecond a layer, and
        # not nothing.
        assert 0.001 < ms < 5.0, ms
        assert stage.n_past(0) == 0
        # The figure is the time of a real step, per layer: the least of several, as the
        # calibration keeps (a busy machine stretches some steps, never shortens one).
        stage.forward([StageInput(seq=1, pos=0, tokens=np.arange(1, 9, dtype=np.int32))])
        steps = []
        for i in range(8):
            t0 = time.perf_counter()
            stage.forward([StageInput(seq=1, pos=8 + i, tokens=np.array([5], np.int32))])
            steps.append((time.perf_counter() - t0) * 1000 / 30)
        assert ms / 4 < min(steps) < ms * 4, (ms, steps)


def test_the_clock_follows_decode_steps_only() -> None:
    clock = LayerClock(10, start=1.0, alpha=0.5)
    clock.record(0.1, [8])  # a prefill says nothing of a step
    clock.record(0.03, [1, 1, 2])
    assert clock.ms == 1.0
    clock.record(0.03, [1, 1])  # 3 ms a layer
    assert clock.ms == pytest.approx(2.0)
    fresh = LayerClock(10)
    fresh.record(0.02, [1])
    assert fresh.ms == pytest.approx(2.0)


def test_a_node_turns_its_runners_timings_into_bytes_a_second() -> None:
    def proc(ms: float, layer_bytes: float, state: str = "ready") -> RunnerProc:
        key = StageKey("i", 0, 1, 0, 10, "m.gguf")
        r = RunnerProc(key=key, config=None, state=state)  # type: ignore[arg-type]
        r.layer_ms, r.layer_bytes = ms, layer_bytes
        return r

    assert decode_bps([]) == 0.0
    assert decode_bps([proc(0.0, 3e6), proc(0.5, 3e6, "loading")]) == 0.0
    # 3 MB a layer in 0.5 ms and 6 MB in 0.75 ms: 6 and 8 GB/s, 7 on average.
    assert decode_bps([proc(0.5, 3e6), proc(0.75, 6e6)]) == pytest.approx(7e9)

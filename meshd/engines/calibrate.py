"""How fast a loaded stage decodes: the figure placement splits layers by.

A runner times a few single-row decode steps on a scratch sequence right after its
stage loads (:func:`calibrate`), then keeps timing the decode steps it really runs
(:class:`LayerClock`). Both give milliseconds per layer of one decode step, which the
node turns into bytes of weights per second (``meshd.node.speed``): decode reads every
weight once a step, so that rate carries over to other models on the same machine.
"""

from __future__ import annotations

import time

import numpy as np

from .stage import Stage, StageInput

#: Rows of the scratch prompt, untimed steps, then timed single-row steps (the
#: fastest is kept).
CALIBRATION_PROMPT = 8
CALIBRATION_WARMUP = 2
CALIBRATION_STEPS = 5


def calibrate(stage: Stage, n_layers: int, seq: int = 0) -> float:
    """Milliseconds per layer of a single-row decode step of ``stage`` (which runs
    ``n_layers`` layers), timed on sequence ``seq`` (which must be free; it is freed
    after). 0.0 if the stage cannot run one (an embedding model)."""
    if not stage.generative:
        return 0.0
    rng = np.random.default_rng(0)

    def rows(n: int) -> StageInput:
        pos = stage.n_past(seq)
        if stage.first:
            # Ids 1..n exist in every vocabulary; the values do not change the time.
            return StageInput(seq=seq, pos=pos, tokens=np.arange(1, n + 1, dtype=np.int32))
        hidden = rng.standard_normal((n, stage.hidden_size)).astype(np.float32)
        return StageInput(seq=seq, pos=pos, hidden=hidden)

    times = []
    try:
        stage.forward([rows(CALIBRATION_PROMPT)])
        # The first single-row steps build and size the engine's graph: not timed.
        for _ in range(CALIBRATION_WARMUP):
            stage.forward([rows(1)])
        for _ in range(CALIBRATION_STEPS):
            t0 = time.perf_counter()
            stage.forward([rows(1)])
            times.append(time.perf_counter() - t0)
    finally:
        stage.free(seq)
    # The least: a machine's speed, not the moment's (a stage loads while others do).
    return 1000 * min(times) / max(1, n_layers)


class LayerClock:
    """A moving figure of milliseconds per layer from the decode steps a stage runs.

    Only calls whose every item is one row count (a prefill's time says nothing of a
    decode step's). Starts from the calibration; each call moves it by ``alpha``."""

    def __init__(self, n_layers: int, start: float = 0.0, alpha: float = 0.1) -> None:
        self.n_layers = max(1, n_layers)
        self.ms = start
        self.alpha = alpha
        #: Decode calls timed so far.
        self.steps = 0
        #: The figure last reported, and when (see :meth:`news`).
        self.reported = start
        self.reported_at = 0.0

    def news(self, now: float, every: float = 2.0, change: float = 0.1) -> bool:
        """Whether the figure moved by more than ``change`` (a fraction) since it was
        last reported, at most once per ``every`` seconds; if so, it counts as
        reported now."""
        if now - self.reported_at < every or self.ms <= 0:
            return False
        if self.reported > 0 and abs(self.ms - self.reported) <= change * self.reported:
            return False
        self.reported, self.reported_at = self.ms, now
        return True

    def record(self, seconds: float, rows: list[int]) -> None:
        """One forward call of ``rows`` rows per item took ``seconds``."""
        if not rows or any(r != 1 for r in rows) or seconds <= 0:
            return
        ms = 1000 * seconds / self.n_layers
        self.steps += 1
        self.ms = ms if self.ms <= 0 else self.ms + self.alpha * (ms - self.ms)

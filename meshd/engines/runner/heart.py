"""The runner's heartbeat: a status line every :data:`~meshd.engines.protocol.BEAT_S`
from a thread of its own, saying how long the engine step under way has run and how
long its measured speed says it should take.

A thread, so that beats come during a long step too (the engines release the GIL in
their native calls): beats that stop mean the process is stopped (SIGSTOP, a laptop
swapping itself to a halt); a step that runs far past its prediction means the engine
hangs (a wedged GPU driver). The node judges either (``meshd.node.watchdog``)."""

from __future__ import annotations

import threading
import time

from meshd.engines.protocol import BEAT_S, Beat

from .links import emit

__all__ = ["Heart"]


class Heart:
    """Beats while started; :meth:`stepping` and :meth:`idle` frame each engine step."""

    def __init__(self, every: float = BEAT_S) -> None:
        self.every = every
        self._since = 0.0
        self._expect = 0.0
        self._stop = threading.Event()

    def start(self) -> None:
        """Beat from now on, until :meth:`stop`."""
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def stop(self) -> None:
        """No more beats."""
        self._stop.set()

    def stepping(self, expect_s: float) -> None:
        """A step starts that should take about ``expect_s`` seconds (0: unknown)."""
        self._expect = expect_s
        self._since = time.monotonic()

    def idle(self) -> None:
        """The step ended."""
        self._since = 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            since, expect = self._since, self._expect  # read once: the loop moves on
            step_s = time.monotonic() - since if since else 0.0
            emit(Beat(step_s=round(step_s, 3), expect_s=round(expect, 3) if since else 0.0))

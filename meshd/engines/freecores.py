"""How many cores are free for this node's runners, and how many threads each takes.

A llama.cpp step ends at a barrier of all its threads: a thread whose core another
process holds makes the others wait (spinning, then asleep) for the rest of its time
slice. On 2 cores with a CPU-bound neighbour on one, a whole-model runner of 2 threads
fell from ~85 to 1.4 tok/s, where 1 thread ran 45-51 tok/s (issue 36). So the threads
follow the cores the other processes leave free, measured while the runners run:

- :class:`FreeCores` measures, from the machine's CPU times (``psutil``: Linux, macOS,
  Windows), the cores of this process's affinity that processes outside this node's
  own tree (the node and its runners) used over the last interval;
- :func:`next_threads` decides, purely, with hysteresis: a thread goes as soon as the
  cores free fall a quarter of a core below the threads (a thread short of a core costs
  an order of magnitude), one comes back only once nine tenths of a core are free for
  it for :data:`UP_SAMPLES` samples in a row (a thread too few costs at most its share).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psutil

__all__ = [
    "DOWN_SLACK",
    "UP_NEED",
    "UP_SAMPLES",
    "FreeCores",
    "Threads",
    "next_threads",
]

#: A runner keeps a thread while the cores free for it are at least its threads less
#: this much (a neighbour taking more than a quarter of a core takes a thread away).
DOWN_SLACK = 0.25
#: A runner gains a thread when this much of a core is free for it beyond its threads.
UP_NEED = 0.9
#: Samples in a row that must find the room before a thread is added (a neighbour that
#: pauses for a moment does not get its core taken back and forth).
UP_SAMPLES = 4


@dataclass(frozen=True)
class Threads:
    """A decision: the thread count, and how many samples in a row found room for more."""

    n: int
    ups: int = 0


def next_threads(current: Threads, free: float, most: int) -> Threads:
    """The thread count after a sample that found ``free`` cores free for this runner
    (its own use included), at most ``most`` and at least 1.

    Down at once to what fits (with :data:`DOWN_SLACK`); up only after
    :data:`UP_SAMPLES` samples in a row found :data:`UP_NEED` of a core per added thread.
    """
    most = max(1, most)
    n = min(max(1, current.n), most)
    down = max(1, math.floor(free + DOWN_SLACK))
    if down < n:
        return Threads(down)
    up = min(most, math.floor(free + 1 - UP_NEED))
    if up <= n:
        return Threads(n)
    ups = current.ups + 1
    return Threads(up) if ups >= UP_SAMPLES else Threads(n, ups)


def _cpus() -> list[int] | None:
    """The CPUs this process may run on (None: every CPU, where affinity is not told)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows
        return None


def _busy(t: Any) -> tuple[float, float]:
    """(busy, total) seconds of one CPU's (or the machine's) times."""
    d = t._asdict()
    # guest time is counted in user already (Linux); idle and iowait are free.
    total = sum(v for k, v in d.items() if k not in ("guest", "guest_nice"))
    free = d.get("idle", 0.0) + d.get("iowait", 0.0)
    return total - free, total


class FreeCores:
    """Samples the cores free for this node's tree: the CPUs it may use, less what the
    other processes used of them since the last sample."""

    def __init__(self) -> None:
        self.cpus = _cpus()
        self.n_cpus = len(self.cpus) if self.cpus else (psutil.cpu_count() or 1)
        self._procs: dict[int, psutil.Process] = {}
        self._times: dict[int, float] = {}
        self._last: tuple[float, float] | None = None

    def _machine(self) -> tuple[float, float]:
        if self.cpus is None:
            b, t = _busy(psutil.cpu_times())
            return b, t / max(1, psutil.cpu_count() or 1)
        per = psutil.cpu_times(percpu=True)
        pairs = [_busy(per[c]) for c in self.cpus if c < len(per)]
        # Wall seconds: each CPU's total advances with the clock.
        return sum(b for b, _ in pairs), sum(t for _, t in pairs) / max(1, len(pairs))

    def _own(self, pids: Iterable[int]) -> float:
        """CPU seconds the processes ``pids`` used since the last sample (a process new
        since then counts from now on; one gone, no more)."""
        used, procs, times = 0.0, {}, {}
        for pid in pids:
            p = self._procs.get(pid)
            try:
                if p is None:
                    p = psutil.Process(pid)
                t = p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            procs[pid], times[pid] = p, t.user + t.system
            if pid in self._times:
                used += max(0.0, times[pid] - self._times[pid])
        self._procs, self._times = procs, times
        return used

    def sample(self, pids: Iterable[int]) -> float | None:
        """Cores free for the processes ``pids`` (this node and its runners) since the
        last sample: the CPUs less what the others used; None on the first sample, or
        when too little time passed to tell."""
        busy, wall = self._machine()
        own = self._own(pids)
        last, self._last = self._last, (busy, wall)
        if last is None or wall - last[1] <= 0.05:
            return None
        others = max(0.0, busy - last[0] - own) / (wall - last[1])
        return max(0.0, self.n_cpus - others)

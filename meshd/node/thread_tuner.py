"""The threads of this node's llama.cpp runners follow the cores other processes leave
free, while they run (see :mod:`meshd.engines.freecores` for why and how it decides).

Every :data:`TUNE_S` the node samples the cores free for its own tree (itself and its
runners), splits them evenly among its ready llama.cpp runners, and tells a runner whose
decided count changed (``SetThreads`` on its stdin: the runner applies it between two
steps and says back what llama.cpp holds, ``ThreadsSet``). A runner never gets more
threads than it started with (its share of the cores, ``threads_per_runner``).
``$MESHD_THREADS`` pins the count: nothing adapts then. MLX runners are left alone: MLX
computes on the GPU and has no thread count to set.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable

from meshd.engines.freecores import FreeCores, Threads, next_threads
from meshd.engines.protocol import SetThreads, encode
from meshd.engines.threads import default_threads, threads_from_env

from .runner_procs import RunnerProc

__all__ = ["TUNE_S", "ThreadTuner", "tune_threads"]

log = logging.getLogger("meshd.supervisor")

#: Seconds between two samples of the free cores: a neighbour that starts costs at most
#: about this long at the old count (2 threads sharing a core with it: ~1.4 tok/s).
TUNE_S = 0.5


def _tunable(r: RunnerProc) -> bool:
    p = r.proc
    return (
        r.state == "ready"
        and r.key.engine == "llama_cpp"
        and p is not None
        and p.stdin is not None
        and p.returncode is None
    )


class ThreadTuner:
    """The thread count decided for each runner process (by pid), told to it when it
    changes."""

    def __init__(self) -> None:
        self.decided: dict[int, Threads] = {}

    def apply(self, runners: Iterable[RunnerProc], free: float) -> None:
        """One sample: ``free`` cores for this node's tree, split among ``runners``'
        ready llama.cpp ones."""
        tuned = [r for r in runners if _tunable(r)]
        decided: dict[int, Threads] = {}
        for r in tuned:
            assert r.proc is not None and r.proc.stdin is not None
            most = r.config.n_threads or default_threads()
            before = self.decided.get(r.proc.pid, Threads(most))
            now = decided[r.proc.pid] = next_threads(before, free / len(tuned), most)
            if now.n != before.n:
                log.info(
                    "runner %s stage %d: %d threads (%.2f cores free here)",
                    r.key.instance, r.key.stage, now.n, free,
                )  # fmt: skip
                r.proc.stdin.write(encode(SetThreads(n=now.n)) + b"\n")
        self.decided = decided  # runners gone are forgotten


def _pids(runners: Iterable[RunnerProc]) -> list[int]:
    own = [os.getpid()]
    return own + [r.proc.pid for r in runners if r.proc is not None and r.proc.returncode is None]


async def tune_threads(
    runners: Callable[[], Iterable[RunnerProc]],
    every: float = TUNE_S,
    free: Callable[[list[int]], float | None] | None = None,
) -> None:
    """Keep the threads of ``runners()`` fitted to the free cores until cancelled
    (returns at once when ``$MESHD_THREADS`` pins them). ``free(pids)``: the cores free
    for those processes since its last call (default: :class:`FreeCores`)."""
    if threads_from_env() is not None:
        return
    sample = free or FreeCores().sample
    tuner = ThreadTuner()
    while True:
        rs = list(runners())
        cores = sample(_pids(rs))
        if cores is not None:
            tuner.apply(rs, cores)
        await asyncio.sleep(every)

"""The thread count follows the free cores, with hysteresis (meshd.engines.freecores).

The decision is pure and tested on numbers; the sampler is tested against a real
CPU-bound child process, counted as the node's own (then nothing is taken away) or as
a neighbour's (then about a core is).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from meshd.engines.freecores import UP_SAMPLES, FreeCores, Threads, next_threads


def test_a_thread_goes_as_soon_as_a_neighbour_takes_a_quarter_of_its_core() -> None:
    assert next_threads(Threads(2), 2.0, 2) == Threads(2)
    assert next_threads(Threads(2), 1.8, 2) == Threads(2)  # a fifth of a core: kept
    assert next_threads(Threads(2), 1.7, 2) == Threads(1)
    assert next_threads(Threads(2), 1.0, 2) == Threads(1)
    assert next_threads(Threads(8), 5.5, 8) == Threads(5)
    assert next_threads(Threads(2), 0.0, 2) == Threads(1)  # never none


def test_a_thread_comes_back_only_after_room_was_found_several_times_in_a_row() -> None:
    t = Threads(1)
    for _ in range(UP_SAMPLES - 1):
        t = next_threads(t, 2.0, 2)
        assert t.n == 1
    # A sample without the room starts the count again.
    assert next_threads(t, 1.5, 2) == Threads(1)
    for _ in range(UP_SAMPLES):
        t = next_threads(t, 1.95, 2)
    assert t == Threads(2)


def test_between_the_two_thresholds_nothing_moves() -> None:
    # 1.8 free: two threads stay two, one thread stays one (no flapping on a
    # neighbour that takes a fifth of a core).
    assert next_threads(Threads(2), 1.8, 2) == Threads(2)
    t = Threads(1)
    for _ in range(3 * UP_SAMPLES):
        t = next_threads(t, 1.8, 2)
    assert t.n == 1


def test_never_more_than_the_runners_share_nor_less_than_one() -> None:
    t = Threads(2)
    for _ in range(UP_SAMPLES * 2):
        t = next_threads(t, 16.0, 2)
    assert t.n == 2
    assert next_threads(Threads(4), 3.0, 2) == Threads(2)  # a smaller share: down at once
    assert next_threads(Threads(0), 1.0, 0) == Threads(1)


@pytest.mark.timeout(60)
def test_the_sampler_counts_a_busy_neighbour_and_not_the_nodes_own_processes() -> None:
    import psutil

    me = os.getpid()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        proc = psutil.Process(spin.pid)
        # Two samplers over the same window: one counts the spinner as the node's own,
        # the other as a neighbour's.
        own, other = FreeCores(), FreeCores()
        assert own.sample([me, spin.pid]) is None and other.sample([me]) is None
        t0 = sum(proc.cpu_times()[:2])
        # Until the spinner has had a tenth of a second of CPU (a loaded machine gives
        # a niced spinner little), however long that takes.
        while sum(proc.cpu_times()[:2]) - t0 < 0.1:
            time.sleep(0.05)
        as_own, as_other = own.sample([me, spin.pid]), other.sample([me])
        used = sum(proc.cpu_times()[:2]) - t0
    finally:
        spin.kill()
        spin.wait()
    assert as_own is not None and as_other is not None
    assert 0.0 <= as_other <= other.n_cpus and 0.0 <= as_own <= own.n_cpus
    # The neighbour's seconds are taken away from what is free; the node's own are not.
    assert as_other < as_own or as_own == 0.0
    assert used >= 0.09  # (clock ticks: 0.1 may read 0.0999...)

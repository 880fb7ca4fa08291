"""What the supervisor decides for each runner it starts (pure rules)."""

from __future__ import annotations

import pytest

from meshd.engines.threads import (
    GOMP_DEFAULT_SPINCOUNT,
    GOMP_SPINCOUNT,
    default_threads,
    runner_spincount,
    threads_per_runner,
)


def test_cores_are_split_among_a_nodes_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHD_THREADS", raising=False)
    cores = default_threads()
    assert threads_per_runner(1) == cores
    assert threads_per_runner(2) == max(1, cores // 2)
    assert threads_per_runner(10 * cores) == 1


def test_meshd_threads_decides_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHD_THREADS", "3")
    assert threads_per_runner(4) is None


def test_only_a_whole_model_alone_on_its_node_keeps_its_threads_spinning() -> None:
    assert runner_spincount(n_stages=1, n_runners=1) == GOMP_DEFAULT_SPINCOUNT
    # A pipeline stage waits for the ring; runners on one node share its cores.
    assert runner_spincount(n_stages=2, n_runners=1) == GOMP_SPINCOUNT
    assert runner_spincount(n_stages=1, n_runners=2) == GOMP_SPINCOUNT
    assert GOMP_SPINCOUNT < GOMP_DEFAULT_SPINCOUNT

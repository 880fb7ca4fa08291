"""What the supervisor decides for each runner it starts (pure rules)."""

from __future__ import annotations

import pytest

from meshd.engines.threads import default_threads, threads_per_runner


def test_cores_are_split_among_a_nodes_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHD_THREADS", raising=False)
    cores = default_threads()
    assert threads_per_runner(1) == cores
    assert threads_per_runner(2) == max(1, cores // 2)
    assert threads_per_runner(10 * cores) == 1


def test_meshd_threads_decides_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHD_THREADS", "3")
    assert threads_per_runner(4) is None

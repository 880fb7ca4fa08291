"""Hybrid logical clock: monotonic under a misbehaving wall clock, bounded drift."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.crdt import HLC, ClockDriftError
from meshd.crdt.hlc import LOGICAL_MASK, logical, pack, physical

# Wall readings around a realistic epoch-ms value, free to jump back and forth.
WALL = st.integers(min_value=1_700_000_000_000, max_value=1_700_000_100_000)
DRIFT = 60_000


class FakeWall:
    """A wall clock the test sets by hand."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


@settings(max_examples=200, deadline=None)
@given(readings=st.lists(WALL, min_size=1, max_size=200))
def test_now_is_strictly_monotonic_when_wall_clock_jumps(readings: list[int]) -> None:
    wall = FakeWall(readings[0])
    clock = HLC(wall=wall)
    prev = clock.last
    for ms in readings:
        wall.ms = ms
        ts = clock.now()
        assert ts > prev
        # The physical part never lags the wall clock it was read against.
        assert physical(ts) >= ms
        assert clock.last == ts
        prev = ts


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(WALL, st.one_of(st.none(), st.integers(-DRIFT, DRIFT)), st.integers(0, 50)),
        min_size=1,
        max_size=100,
    )
)
def test_observe_result_exceeds_remote_and_previous(
    steps: list[tuple[int, int | None, int]],
) -> None:
    wall = FakeWall(steps[0][0])
    clock = HLC(wall=wall, max_drift_ms=DRIFT)
    for ms, offset, remote_logical in steps:
        wall.ms = ms
        prev = clock.last
        if offset is None:
            ts = clock.now()
        else:
            remote = pack(ms + offset, remote_logical)
            ts = clock.observe(remote)
            assert ts > remote
        assert ts > prev
        assert clock.last == ts


@settings(max_examples=100, deadline=None)
@given(
    history=st.lists(WALL, min_size=0, max_size=20),
    now_ms=WALL,
    ahead=st.integers(DRIFT + 1, 10 * DRIFT),
    remote_logical=st.integers(0, LOGICAL_MASK),
)
def test_remote_too_far_ahead_raises_and_leaves_clock_unchanged(
    history: list[int], now_ms: int, ahead: int, remote_logical: int
) -> None:
    wall = FakeWall(now_ms)
    clock = HLC(wall=wall, max_drift_ms=DRIFT)
    for ms in history:
        wall.ms = ms
        clock.now()
    wall.ms = now_ms
    before = clock.last
    remote = pack(now_ms + ahead, remote_logical)
    with pytest.raises(ClockDriftError) as info:
        clock.observe(remote)
    assert info.value.remote == remote
    assert info.value.ahead_ms == ahead
    assert clock.last == before
    with pytest.raises(ClockDriftError):
        clock.check(remote)
    assert clock.last == before


def test_remote_exactly_at_drift_bound_is_accepted() -> None:
    clock = HLC(wall=FakeWall(1_000_000), max_drift_ms=DRIFT)
    remote = pack(1_000_000 + DRIFT, 7)
    assert clock.observe(remote) > remote


@settings(max_examples=100, deadline=None)
@given(ms=WALL, start_logical=st.integers(LOGICAL_MASK - 5, LOGICAL_MASK), n=st.integers(1, 20))
def test_logical_overflow_borrows_a_millisecond_and_keeps_order(
    ms: int, start_logical: int, n: int
) -> None:
    # The wall clock is frozen, so only the logical counter can move.
    clock = HLC(wall=FakeWall(ms), last=pack(ms, start_logical))
    prev = clock.last
    for _ in range(n):
        ts = clock.now()
        assert ts > prev
        assert 0 <= logical(ts) <= LOGICAL_MASK
        prev = ts
    # Observing a remote whose counter is saturated also moves strictly past it.
    remote = pack(physical(prev), LOGICAL_MASK)
    assert clock.observe(remote) > remote


def test_full_logical_range_on_a_frozen_wall_clock_stays_ordered() -> None:
    clock = HLC(wall=FakeWall(5_000))
    stamps = [clock.now() for _ in range(LOGICAL_MASK + 10)]
    assert all(a < b for a, b in itertools.pairwise(stamps))
    assert physical(stamps[-1]) == 5_001


@settings(max_examples=200, deadline=None)
@given(
    a=st.tuples(st.integers(0, 2**40), st.integers(0, LOGICAL_MASK)),
    b=st.tuples(st.integers(0, 2**40), st.integers(0, LOGICAL_MASK)),
)
def test_timestamp_orders_like_its_physical_logical_pair(
    a: tuple[int, int], b: tuple[int, int]
) -> None:
    ta, tb = pack(*a), pack(*b)
    assert (physical(ta), logical(ta)) == a
    assert (ta < tb) == (a < b)
    assert (ta == tb) == (a == b)

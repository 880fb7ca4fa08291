"""Liveness from heartbeats: timeouts on the reader's clock, hysteresis, replay safety."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.crdt import Liveness

SUSPECT, DEAD = 1.5, 2.5

# Monotonic clocks start anywhere: a freshly booted laptop or a server up for months.
starts = st.floats(min_value=0.0, max_value=1e7, allow_nan=False, allow_infinity=False)
revive = st.integers(1, 4)


def tracker(revive_beats: int = 2) -> Liveness:
    return Liveness(suspect_after=SUSPECT, dead_after=DEAD, revive_beats=revive_beats)


def kill(live: Liveness, node: str, t0: float) -> tuple[int, float]:
    """One beat at ``t0``, then silence until the node is dead. Returns (seq, now)."""
    live.beat(node, 10, t0)
    now = t0 + DEAD + 1.0
    assert live.state(node, now) == "dead"
    return 10, now


@settings(max_examples=200, deadline=None)
@given(t0=starts)
def test_first_heartbeat_makes_a_node_alive(t0: float) -> None:
    live = tracker()
    assert live.state("a", t0) is None
    live.beat("a", 1, t0)
    assert live.state("a", t0) == "alive"
    assert live.is_live("a", t0)
    assert live.age("a", t0) == 0.0
    assert live.nodes() == ["a"]


@settings(max_examples=200, deadline=None)
@given(t0=starts, silence=st.floats(0.0, 10 * DEAD, allow_nan=False))
def test_silence_turns_alive_into_suspect_then_dead(t0: float, silence: float) -> None:
    live = tracker()
    live.beat("a", 1, t0)
    now = t0 + silence
    age = now - t0  # what the tracker sees, float rounding included
    expected = "alive" if age <= SUSPECT else "suspect" if age <= DEAD else "dead"
    assert live.state("a", now) == expected
    assert live.is_live("a", now) == (expected != "dead")


@settings(max_examples=100, deadline=None)
@given(t0=starts, steps=st.lists(st.floats(0.0, 3 * DEAD, allow_nan=False), max_size=20))
def test_state_read_at_growing_times_never_improves_without_a_beat(
    t0: float, steps: list[float]
) -> None:
    live = tracker()
    live.beat("a", 1, t0)
    rank = {"alive": 0, "suspect": 1, "dead": 2}
    now, worst = t0, 0
    for dt in steps:
        now += dt
        r = rank[live.state("a", now)]
        assert r >= worst
        worst = r


@settings(max_examples=200, deadline=None)
@given(t0=starts, gap=st.floats(0.0, DEAD, allow_nan=False), n=revive)
def test_a_single_late_beat_does_not_revive_a_dead_node(t0: float, gap: float, n: int) -> None:
    live = tracker(revive_beats=max(n, 2))
    seq, now = kill(live, "a", t0)
    live.beat("a", seq + 1, now)
    assert live.state("a", now) == "dead"
    assert live.state("a", now + gap) == "dead"
    assert not live.is_live("a", now + gap)


@settings(max_examples=200, deadline=None)
@given(t0=starts, n=revive, spacing=st.floats(0.01, DEAD, allow_nan=False))
def test_dead_node_revives_after_revive_beats_in_a_row(t0: float, n: int, spacing: float) -> None:
    live = tracker(revive_beats=n)
    seq, now = kill(live, "a", t0)
    for i in range(1, n + 1):
        assert live.state("a", now) == "dead"
        live.beat("a", seq + i, now)
        if i < n:
            now += spacing
    assert live.state("a", now) == "alive"


@settings(max_examples=100, deadline=None)
@given(t0=starts)
def test_revival_beats_must_be_close_together(t0: float) -> None:
    live = tracker(revive_beats=2)
    seq, now = kill(live, "a", t0)
    live.beat("a", seq + 1, now)
    # The second beat comes after another dead-length silence: the count starts over.
    now += DEAD + 0.5
    live.beat("a", seq + 2, now)
    assert live.state("a", now) == "dead"
    now += 0.5
    live.beat("a", seq + 3, now)
    assert live.state("a", now) == "alive"


@settings(max_examples=200, deadline=None)
@given(t0=starts, old=st.integers(0, 10), stopped=st.booleans(), n=revive)
def test_an_old_replayed_seq_does_not_count(t0: float, old: int, stopped: bool, n: int) -> None:
    live = tracker(revive_beats=n)
    seq, now = kill(live, "a", t0)
    assert old <= seq
    for _ in range(n + 1):
        live.beat("a", old, now, stopped=stopped)  # a replay
    assert live.state("a", now) == "dead"
    # Nor does a replay refresh an alive node's age.
    live2 = tracker()
    live2.beat("b", 10, t0)
    later = t0 + SUSPECT + 0.5
    live2.beat("b", old, later, stopped=stopped)
    assert live2.age("b", later) == later - t0
    assert live2.state("b", later) == "suspect"


def test_a_replayed_goodbye_does_not_mark_a_restarted_node_left() -> None:
    live = tracker()
    live.beat("a", 5, 100.0, stopped=True)
    assert live.state("a", 100.0) == "left"
    live.beat("a", 6, 101.0)
    live.beat("a", 7, 101.5)
    assert live.state("a", 101.5) == "alive"
    live.beat("a", 5, 101.6, stopped=True)  # the old goodbye, delivered late
    assert live.state("a", 101.6) == "alive"


@settings(max_examples=200, deadline=None)
@given(t0=starts, later=st.floats(0.0, 1e4, allow_nan=False), was_dead=st.booleans())
def test_stopped_beat_makes_a_node_left_at_once(t0: float, later: float, was_dead: bool) -> None:
    live = tracker()
    if was_dead:
        seq, now = kill(live, "a", t0)
    else:
        live.beat("a", 10, t0)
        seq, now = 10, t0
    live.beat("a", seq + 1, now, stopped=True)
    assert live.state("a", now) == "left"
    # Left stays left (it does not decay into dead), and is not live.
    assert live.state("a", now + later) == "left"
    assert not live.is_live("a", now + later)


@settings(max_examples=100, deadline=None)
@given(t0=starts, n=revive)
def test_a_node_that_left_and_restarts_comes_back_with_hysteresis(t0: float, n: int) -> None:
    live = tracker(revive_beats=n)
    live.beat("a", 1, t0, stopped=True)
    now = t0 + 10.0
    for i in range(n):
        assert live.state("a", now) == "left"
        live.beat("a", 2 + i, now)
        now += 0.5
    assert live.state("a", now) == "alive"


def test_nodes_are_tracked_independently() -> None:
    live = tracker()
    live.beat("a", 1, 1000.0)
    live.beat("b", 1, 1000.0 + DEAD)
    assert live.state("a", 1000.0 + DEAD + 0.1) == "dead"
    assert live.state("b", 1000.0 + DEAD + 0.1) == "alive"
    assert sorted(live.nodes()) == ["a", "b"]

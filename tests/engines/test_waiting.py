"""Stage 0's queue, as a pure thing: whose turn it is, and what each waiting request
is told (``meshd.engines.runner.waiting``)."""

from __future__ import annotations

from meshd.domain.job import Job
from meshd.engines.runner.waiting import NOTICE_EVERY_S, NOTICE_MIN_S, WaitQueue, fair_order
from meshd.transport import wire

ADDR = wire.Addr(node="api", addresses=["127.0.0.1"], port=1)


def _g(req: str, client: str, generation: int = 1) -> wire.Generate:
    return wire.Generate(
        req=req, instance="i", generation=generation, route=[ADDR], reply_to=ADDR,
        job=Job(prompt="hi", client=client),
    )  # fmt: skip


def _queue(*reqs: tuple[str, str]) -> WaitQueue:
    q = WaitQueue(cap=100)
    for i, (req, client) in enumerate(reqs):
        q.add(_g(req, client), now=float(i))
    return q


def test_the_client_with_least_in_service_goes_first_and_a_clients_own_keep_their_order() -> None:
    q = _queue(("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("a4", "A"), ("b2", "B"))
    # A holds the only seat: B's first request is next, then they take turns.
    order = fair_order(list(q._by_req.values()), {"A": 1})
    assert [w.g.req for w in order] == ["b1", "a1", "b2", "a2", "a3", "a4"]
    # Nobody seated: arrival breaks the ties, each client in turn.
    order = fair_order(list(q._by_req.values()), {})
    assert [w.g.req for w in order] == ["a1", "b1", "a2", "b2", "a3", "a4"]


def test_a_lone_request_is_not_held_back_by_a_flood() -> None:
    q = _queue(*[(f"a{i}", "A") for i in range(60)], ("b", "B"))
    w = q.take({"A": 8}, now=100.0)
    assert w is not None and w.g.req == "b" and w.since == 60.0
    assert len(q) == 60
    assert [q.take({"A": 8}, now=101.0).g.req for _ in range(3)] == ["a0", "a1", "a2"]  # type: ignore[union-attr]


def test_each_waiting_request_hears_its_place_when_it_changes_and_every_few_seconds() -> None:
    q = _queue(("a1", "A"), ("a2", "A"))
    first = q.notices({"A": 1}, now=10.0)
    assert [(n.g.req, n.place, n.eta_s) for n in first] == [("a1", 1, 0.0), ("a2", 2, 0.0)]
    assert q.notices({"A": 1}, now=10.1) == []  # nothing new, nothing due
    q.add(_g("b1", "B"), now=10.2)
    # b1 is told at once; a1 and a2 moved back but were told a moment ago.
    assert [(n.g.req, n.place) for n in q.notices({"A": 1}, now=10.2)] == [("b1", 1)]
    later = q.notices({"A": 1}, now=10.0 + NOTICE_MIN_S)
    assert [(n.g.req, n.place) for n in later] == [("a1", 2), ("a2", 3)]
    # Unchanged places are told again as a sign of life.
    again = q.notices({"A": 1}, now=10.0 + NOTICE_MIN_S + NOTICE_EVERY_S)
    assert [(n.g.req, n.place) for n in again] == [("b1", 1), ("a1", 2), ("a2", 3)]


def test_the_expected_start_is_the_place_times_the_measured_turnover() -> None:
    q = _queue(*[(f"a{i}", "A") for i in range(5)])
    assert q.take({}, now=10.0) is not None  # the first take starts the clock
    assert q.take({}, now=12.0) is not None
    assert q.turnover_s == 2.0
    assert q.take({}, now=13.0) is not None
    assert q.turnover_s == 0.8 * 2.0 + 0.2 * 1.0
    places = {n.g.req: (n.place, n.eta_s) for n in q.notices({}, now=13.0)}
    assert places == {"a3": (1, 1.8), "a4": (2, 3.6)}
    # An empty queue stops the clock: the idle time after is no turnover.
    q.take({}, now=14.0), q.take({}, now=15.0)
    assert q.take({}, now=16.0) is None
    q.add(_g("late", "A"), now=100.0)
    assert q.take({}, now=100.0) is not None and q.turnover_s < 2.0


def test_cancel_full_and_a_plan_change_take_requests_out() -> None:
    q = WaitQueue(cap=2)
    q.add(_g("x", "A"), now=0.0)
    assert not q.full()
    q.add(_g("old", "B", generation=0), now=0.0)
    assert q.full()
    assert q.remove("nope") is None and q.remove("x") is not None
    assert [g.req for g in q.drop_generation(keep=1)] == ["old"]
    assert len(q) == 0 and list(q) == []


def test_among_equals_the_client_whose_last_turn_is_oldest_goes_first() -> None:
    q = WaitQueue(cap=100)
    q.turn("A")  # A's request took the free sequence straight away, then ended
    q.add(_g("a1", "A"), now=1.0)
    q.add(_g("b1", "B"), now=2.0)
    q.add(_g("c1", "C"), now=3.0)
    assert [q.take({}, now=4.0).g.req for _ in range(3)] == ["b1", "c1", "a1"]  # type: ignore[union-attr]

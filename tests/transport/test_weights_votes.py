"""Which root a fetch takes from the holders' offers (``Votes``): pure counting."""

from __future__ import annotations

from meshd.transport.weights_votes import Verdict, Votes

GOOD = ("a" * 64, 100, 10)
BAD = ("b" * 64, 100, 10)


def test_a_majority_of_the_listed_holders_decides_at_once() -> None:
    v = Votes(wait=60)
    v.offered("liar", BAD, now=0)
    assert v.decide(["h1", "h2", "liar"], now=0) == Verdict()  # 1 of 3: wait
    v.offered("h1", GOOD, now=0.1)
    assert v.decide(["h1", "h2", "liar"], now=0.1) == Verdict()  # 1:1, h2 not heard
    v.offered("h2", GOOD, now=0.2)
    assert v.decide(["h1", "h2", "liar"], now=0.2) == Verdict(GOOD, ("h1", "h2"))


def test_a_lone_holder_is_taken_at_its_word() -> None:
    v = Votes(wait=60)
    v.offered("only", GOOD, now=0)
    assert v.decide(["only"], now=0) == Verdict(GOOD, ("only",))


def test_without_a_majority_the_holders_that_answered_decide_once_all_did_or_the_wait_ran_out() -> (
    None
):
    v = Votes(wait=5)
    for n, o in (("h1", GOOD), ("h2", GOOD), ("l1", BAD)):
        v.offered(n, o, now=0)
    listed = ["h1", "h2", "l1", "slow", "gone"]
    assert v.decide(listed, now=1) == Verdict()  # 2 of 5 is no majority: wait
    assert v.decide(listed, now=5) == Verdict(GOOD, ("h1", "h2"))  # waited: 2 beat 1
    # Every voter answered: no need to wait.
    v.refusal("slow")  # holds another file: no voter
    v.offered("gone", BAD, now=2)
    tie = "h1, h2 offer root aaaaaaaaaaaa; gone, l1 offer root bbbbbbbbbbbb"
    assert v.decide(listed, now=2).tie == tie


def test_a_tie_names_who_offers_what_and_takes_nothing() -> None:
    v = Votes(wait=0)
    v.offered("a", GOOD, now=0)
    v.offered("b", BAD, now=0)
    verdict = v.decide(["a", "b"], now=0)
    assert verdict.offer is None and "a offers root aaaa" in verdict.tie
    assert "b offers root bbbb" in verdict.tie


def test_holders_whose_root_failed_verification_vote_no_more() -> None:
    v = Votes(wait=60)
    v.offered("liar", BAD, now=0)
    assert v.decide(["liar", "honest"], now=60).offer == BAD  # waited: the liar alone
    assert v.distrust(BAD, "header differs") == ["liar"]
    assert v.decide(["liar", "honest"], now=61) == Verdict()  # the honest one not heard yet
    v.offered("honest", GOOD, now=62)
    assert v.decide(["liar", "honest"], now=62) == Verdict(GOOD, ("honest",))
    v.offered("liar", BAD, now=63)  # offering again gives it no vote back
    assert v.decide(["liar", "honest"], now=63) == Verdict(GOOD, ("honest",))


def test_a_tie_while_holders_are_still_to_answer_waits_for_them() -> None:
    v = Votes(wait=1)
    v.offered("liar", BAD, now=0)
    assert v.decide(["liar", "h1", "h2"], now=1).offer == BAD  # waited: the liar alone
    v.offered("h1", GOOD, now=2)
    assert v.decide(["liar", "h1", "h2"], now=2) == Verdict()  # 1:1, h2 decides
    v.offered("h2", GOOD, now=3)
    assert v.decide(["liar", "h1", "h2"], now=3) == Verdict(GOOD, ("h1", "h2"))


def test_while_the_count_is_open_the_front_is_the_most_offered_then_the_earliest() -> None:
    v = Votes(wait=60)
    assert v.front() is None
    v.offered("liar", BAD, now=0)
    v.offered("h1", GOOD, now=1)
    assert v.front() == BAD  # 1:1, the liar came first
    v.offered("h2", GOOD, now=2)
    assert v.front() == GOOD

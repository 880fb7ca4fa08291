"""A node's admission, as a pure thing: its limit, each client's fair share past it,
and the Retry-After it gives (``meshd.api.limits``)."""

from __future__ import annotations

import pytest

from meshd.api.limits import MAX_RETRY_S, OVER_FAIR, Admission, client_id


def test_admission_is_bounded_and_tickets_release_once() -> None:
    adm = Admission(2)
    t1, t2 = adm.enter("A"), adm.enter("A")
    assert t1 and t2 and adm.enter("A") is None
    t1.release()
    t1.release()
    assert adm.in_flight == 1 and adm.by_client == {"A": 1}
    assert adm.enter("A") is not None and adm.enter("A") is None


def test_past_the_limit_a_client_under_its_fair_share_still_gets_in_up_to_a_bound() -> None:
    adm = Admission(8)
    flood = [adm.enter("A") for _ in range(8)]
    assert all(flood) and adm.enter("A") is None
    # B holds nothing of its share (8 // 2): it is taken past the limit, ...
    assert adm.enter("B") is not None
    # ... C too (8 // 3 = 2 each), but never past a bound over the limit.
    assert adm.enter("C") is not None
    assert adm.in_flight == 8 + int(8 * OVER_FAIR)
    assert adm.enter("C") is None and adm.enter("D") is None
    # Once A's flood drains, everyone is under the limit again.
    for t in flood:
        assert t is not None
        t.release()
    assert adm.enter("A") is not None and adm.by_client == {"A": 1, "B": 1, "C": 1}


def test_retry_after_follows_the_rate_requests_end_at() -> None:
    adm = Admission(4)
    held = [adm.enter("A") for _ in range(4)]
    assert adm.retry_after(now=0.0) == 5.0  # nothing ended yet: a guess
    for i, t in enumerate(held[:2]):
        assert t is not None
        t._admission._release("A", now=10.0 + i)  # two ended, a second apart
        t._held = False
    held += [adm.enter("A"), adm.enter("A")]
    # Full (4 in flight): one request ended per second lately, the next slot in ~1 s;
    # the further past the limit, the longer.
    assert adm.retry_after(now=11.0) == pytest.approx(1.0)
    adm.in_flight += 3
    assert adm.retry_after(now=11.0) == pytest.approx(4.0)
    # A minute later with nothing ended: the guess, never past the cap.
    assert adm.retry_after(now=100.0) == 5.0 <= MAX_RETRY_S


def test_a_client_is_its_own_key_else_its_address() -> None:
    shared = b"node-wide-key"
    alice = client_id(b"sk-alice", "10.0.0.2", shared)
    assert alice.startswith("key:") and "sk-alice" not in alice
    assert alice == client_id(b"sk-alice", "10.0.0.9", shared)  # same key, any address
    assert alice != client_id(b"sk-bob", "10.0.0.2", shared)
    # The node's shared key tells nobody apart: the address does.
    assert client_id(shared, "10.0.0.2", shared) == "ip:10.0.0.2"
    assert client_id(b"", "10.0.0.3", None) == "ip:10.0.0.3"

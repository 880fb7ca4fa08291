"""Keep-alive, decided purely (meshd.domain.keepalive): Ollama's values parsed, and the
rule that puts an instance to sleep from the API nodes' words. The real thing, a split
instance unloaded by one request and loaded again by the next, is in
tests/api/test_ollama.py."""

from __future__ import annotations

import math

import pytest

from meshd.domain.keepalive import (
    FOREVER,
    Awake,
    asleep,
    expires,
    live_words,
    parse_keep_alive,
    until,
)


def test_ollamas_values_in_seconds() -> None:
    assert parse_keep_alive(None) is None
    assert parse_keep_alive(0) == 0.0
    assert parse_keep_alive(300) == 300.0
    assert parse_keep_alive("10m") == 600.0
    assert parse_keep_alive("1h30m") == 5400.0
    assert parse_keep_alive("1.5s") == 1.5
    assert parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive("30") == 30.0  # a bare number string: seconds
    assert parse_keep_alive(-1) == math.inf and parse_keep_alive("-1m") == math.inf
    for bad in ("soon", "5 minutes", "m", "", "1d", "nan"):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)
    with pytest.raises(ValueError):
        parse_keep_alive(True)


def test_until_is_bounded_so_that_forever_travels_as_json() -> None:
    assert until(100.0, 5.0) == 105.0
    assert until(100.0, math.inf) == FOREVER
    assert until(100.0, -3.0) == 100.0


def test_the_latest_word_decides_unless_a_request_runs() -> None:
    kept, dropped = Awake(set_at=10.0, until=400.0), Awake(set_at=20.0, until=20.0)
    # The later word said keep_alive 0: asleep at once, whatever the earlier one said.
    assert asleep([kept, dropped], busy=False, fallback=0.0, now=21.0)
    assert not asleep([dropped, Awake(set_at=30.0, until=330.0)], False, 0.0, 31.0)
    # A request running through any API node, or on the runners here, keeps it up.
    assert not asleep([dropped, Awake(set_at=5.0, until=5.0, busy=True)], False, 0.0, 21.0)
    assert not asleep([dropped], busy=True, fallback=0.0, now=21.0)
    # Nobody said anything: the node's own default after it was last busy.
    assert not asleep([], False, fallback=50.0, now=49.0)
    assert asleep([], False, fallback=50.0, now=50.0)


def test_the_expiry_ollamas_ps_shows_is_the_latest_live_words() -> None:
    class Beat:
        def __init__(self, **awake: Awake) -> None:
            self.awake = awake

    old, new = Awake(set_at=10.0, until=700.0), Awake(set_at=20.0, until=320.0)
    words = live_words({"a": Beat(i=old), "b": Beat(i=new), "gone": Beat(j=new)}, "ab".__contains__)
    assert words == {"i": [old, new]}  # a node no longer live says nothing
    assert expires(words["i"]) == 320.0  # the later word, though it ends sooner
    assert expires([Awake(set_at=30.0, until=FOREVER)]) is None  # kept forever
    assert expires([]) is None  # nobody said: its nodes' own default

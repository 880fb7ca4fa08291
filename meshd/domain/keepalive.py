"""How long an instance stays loaded after its last request (Ollama's ``keep_alive``).

Every API node says, in its heartbeat, for each instance it sent requests to: when it
last decided (``set_at``), until when it wants the instance loaded (``until``, epoch
seconds), and whether a request of its own runs on it now (``busy``). The nodes that
run the instance's stages read every live node's word: the instance stays loaded while
any of them is busy, else until the ``until`` of the latest word (as in Ollama, the
last request's ``keep_alive`` decides), and, where no API node said anything yet, for
the default keep-alive after its runner was last seen busy. Then its runners stop (their
memory is given back); the plan stays in the cluster, and the first request through
any node's API wakes it (the request waits for the load).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import msgspec

__all__ = [
    "DEFAULT_KEEP_ALIVE_S",
    "FOREVER",
    "Awake",
    "Heard",
    "asleep",
    "expires",
    "live_words",
    "parse_keep_alive",
    "until",
]

#: Seconds an instance stays loaded after its last request when nobody says (Ollama's).
DEFAULT_KEEP_ALIVE_S = 300.0
#: ``until`` of an instance kept loaded forever (a negative ``keep_alive``): a finite
#: number, so that it travels as JSON too.
FOREVER = 1e12

_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class Awake(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True, array_like=True):
    """One API node's word on one instance (see the module doc)."""

    set_at: float
    until: float
    busy: bool = False


def parse_keep_alive(value: str | float | None) -> float | None:
    """Seconds of a ``keep_alive`` as Ollama takes it: a number of seconds, or a Go
    duration (``"10m"``, ``"1h30m"``, ``"90s"``; a bare number string is seconds);
    negative keeps forever (``math.inf``); None: not said. Raises ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("keep_alive is a duration such as '5m', or a number of seconds")
    seconds = float(value) if isinstance(value, int | float) else _duration(value.strip())
    if math.isnan(seconds):
        raise ValueError("keep_alive is a duration such as '5m', or a number of seconds")
    return math.inf if seconds < 0 else seconds


def _duration(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(
            f"keep_alive {text!r} is not a duration such as '5m' or '1h30m', nor seconds"
        )
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


def until(now: float, seconds: float) -> float:
    """When a keep-alive of ``seconds`` from ``now`` ends (:data:`FOREVER` at most)."""
    return FOREVER if seconds >= FOREVER - now else now + max(0.0, seconds)


def asleep(words: Iterable[Awake], busy: bool, fallback: float, now: float) -> bool:
    """Whether an instance's runners should be unloaded now: nobody's request runs on
    it (``busy``: its runners here hold one; a word's ``busy``: an API node's does) and
    the latest word's ``until`` has passed (``fallback``, when no node said anything)."""
    said = list(words)
    if busy or any(w.busy for w in said):
        return False
    end = max(said, key=lambda w: w.set_at).until if said else fallback
    return now >= end


def expires(words: Iterable[Awake]) -> float | None:
    """When an instance's keep-alive ends, as the latest word says (epoch seconds);
    None when kept forever, or when nobody said (its nodes' own default then runs from
    their last request, which no API node sees)."""
    said = list(words)
    if not said:
        return None
    end = max(said, key=lambda w: w.set_at).until
    return None if end >= FOREVER else end


class Heard(Protocol):
    """What a node's heartbeat says of keep-alives (``Health.awake``)."""

    @property
    def awake(self) -> Mapping[str, Awake]: ...


def live_words(healths: Mapping[str, Heard], live: Callable[[str], bool]) -> dict[str, list[Awake]]:
    """Per instance, the words of the nodes that are ``live`` (``healths``: by node)."""
    words: dict[str, list[Awake]] = {}
    for nid, h in healths.items():
        if live(nid):
            for iid, w in h.awake.items():
                words.setdefault(iid, []).append(w)
    return words

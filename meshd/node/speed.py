"""How fast this node's requests go, over the last minute: what its heartbeat tells
the cluster (``Health.tokens_s`` and ``Health.serving``) and ``meshctl top`` shows.

Kept per instance, not per model: two instances of one model (replicas, or a split
placed beside the automatic one) run on other nodes at other speeds, and each
instance's view adds up only its own figures.

The API records each request as it runs (:meth:`Speed.began`, :meth:`Speed.token`,
:meth:`Speed.ended`); :meth:`Speed.summary` reads the window at heartbeat time. Samples
older than :data:`WINDOW_S` are dropped as they age, so memory stays bounded by the
tokens of one minute (a few thousand samples at most on a home machine).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from meshd.crdt.views import ModelSpeed

__all__ = ["RATE_WINDOW_S", "WINDOW_S", "Speed"]

#: Percentiles and per-stage times are over this many seconds.
WINDOW_S = 60.0
#: Tokens per second are over this many (short: top shows what runs now).
RATE_WINDOW_S = 10.0
#: Samples kept per kind and instance at most (a bound whatever the rate).
MAX_SAMPLES = 4096


@dataclass
class _Model:
    in_flight: int = 0
    #: (time, tokens) of each chunk with tokens.
    tokens: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    ttft: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    itl: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    #: (time, seconds of each stage) for one step.
    stages: deque[tuple[float, list[float]]] = field(
        default_factory=lambda: deque(maxlen=MAX_SAMPLES)
    )
    hop: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))


def _trim(d: deque, since: float) -> None:
    while d and d[0][0] < since:
        d.popleft()


def _p50_ms(d: deque[tuple[float, float]]) -> float:
    return round(statistics.median(v for _, v in d) * 1000, 2) if d else 0.0


class Speed:
    """The last minute of this node's requests, per instance (by its id)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._models: dict[str, _Model] = {}

    def _m(self, instance: str) -> _Model:
        m = self._models.get(instance)
        if m is None:
            m = self._models[instance] = _Model()
        return m

    def now(self) -> float:
        """The clock the samples are on."""
        return self._clock()

    def began(self, instance: str) -> None:
        """A request on ``instance`` started."""
        self._m(instance).in_flight += 1

    def ended(self, instance: str) -> None:
        """A request on ``instance`` ended (however it ended)."""
        m = self._m(instance)
        m.in_flight = max(0, m.in_flight - 1)

    def token(
        self,
        instance: str,
        n: int,
        *,
        ttft: float | None = None,
        itl: float | None = None,
        stages: list[float] | None = None,
        hop: float | None = None,
    ) -> None:
        """A chunk of ``n`` tokens arrived: the time to it (first) or since the last
        one, each stage's compute for its step, and the per-hop overhead."""
        t = self.now()
        m = self._m(instance)
        m.tokens.append((t, n))
        if ttft is not None:
            m.ttft.append((t, ttft))
        if itl is not None:
            m.itl.append((t, itl))
        if stages:
            m.stages.append((t, list(stages)))
        if hop is not None:
            m.hop.append((t, hop))

    def summary(self) -> tuple[float, dict[str, ModelSpeed]]:
        """This node's tokens per second over :data:`RATE_WINDOW_S`, and each
        instance's figures over :data:`WINDOW_S`, by instance id (instances with nothing
        to say are left out)."""
        now = self.now()
        total = 0.0
        out: dict[str, ModelSpeed] = {}
        for name, m in list(self._models.items()):
            for d in (m.tokens, m.ttft, m.itl, m.stages, m.hop):
                _trim(d, now - WINDOW_S)
            window = [(t, n) for t, n in m.tokens if t >= now - RATE_WINDOW_S]
            # A stream that began within the window is measured over its own span (a
            # second at least), so top shows its speed at once, not a ramp over 10 s.
            span = max(1.0, now - window[0][0]) if window else RATE_WINDOW_S
            rate = round(sum(n for _, n in window) / min(span, RATE_WINDOW_S), 2)
            total += rate
            if not (m.in_flight or m.tokens):
                del self._models[name]
                continue
            width = max((len(s) for _, s in m.stages), default=0)
            stage_ms = [
                round(statistics.median(s[i] for _, s in m.stages if len(s) > i) * 1000, 2)
                for i in range(width)
            ]
            out[name] = ModelSpeed(
                tokens_s=rate, in_flight=m.in_flight, ttft_ms=_p50_ms(m.ttft),
                itl_ms=_p50_ms(m.itl), stage_ms=stage_ms, hop_ms=_p50_ms(m.hop),
            )  # fmt: skip
        return round(total, 2), out

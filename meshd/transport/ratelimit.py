"""Per-peer token buckets: one chatty or hostile peer cannot monopolise a node's merge loop."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["PeerRateLimiter"]


class PeerRateLimiter:
    """A token bucket per peer: ``rate`` messages a second, bursts up to ``burst``.

    At most ``max_peers`` buckets are kept (least recently used go first), so a flood
    of made-up sender ids costs bounded memory.
    """

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        max_peers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.max_peers = max_peers
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, peer: str) -> bool:
        """Take one token from ``peer``'s bucket; False when it is empty (drop the message)."""
        now = self._clock()
        tokens, last = self._buckets.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        if ok:
            tokens -= 1.0
        self._buckets[peer] = (tokens, now)
        if len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return ok

"""Hybrid logical clock.

A timestamp is one int: ``physical_ms << 16 | logical``. Ints compare fast, pack small
in msgpack, and order exactly as the (physical, logical) pair does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

LOGICAL_BITS = 16
LOGICAL_MASK = (1 << LOGICAL_BITS) - 1

#: Default bound on how far a remote timestamp may run ahead of our wall clock.
DEFAULT_MAX_DRIFT_MS = 60_000


class ClockDriftError(ValueError):
    """A remote timestamp is further in the future than the configured bound allows."""

    def __init__(self, remote: int, local_wall_ms: int, max_drift_ms: int) -> None:
        ahead = physical(remote) - local_wall_ms
        super().__init__(
            f"remote timestamp is {ahead} ms ahead of the local wall clock "
            f"(bound {max_drift_ms} ms); rejected"
        )
        self.remote = remote
        self.ahead_ms = ahead


def pack(physical_ms: int, logical: int) -> int:
    """Build a timestamp from its two parts."""
    return (physical_ms << LOGICAL_BITS) | logical


def physical(ts: int) -> int:
    """Wall-clock milliseconds of a timestamp."""
    return ts >> LOGICAL_BITS


def logical(ts: int) -> int:
    """Logical counter of a timestamp."""
    return ts & LOGICAL_MASK


def wall_ms() -> int:
    """The system wall clock in milliseconds (the default physical source)."""
    return time.time_ns() // 1_000_000


class HLC:
    """A hybrid logical clock (Kulkarni et al., 2014).

    ``now()`` is strictly monotonic even when the wall clock steps back; ``observe()``
    folds in a remote timestamp so that causally later events get larger stamps, and
    refuses one that is more than ``max_drift_ms`` ahead of our own wall clock, so a
    peer with a broken clock cannot drag the whole cluster into the future.
    """

    __slots__ = ("_last", "max_drift_ms", "wall")

    def __init__(
        self,
        wall: Callable[[], int] = wall_ms,
        max_drift_ms: int = DEFAULT_MAX_DRIFT_MS,
        last: int = 0,
    ) -> None:
        self.wall = wall
        self.max_drift_ms = max_drift_ms
        self._last = last

    @property
    def last(self) -> int:
        """The largest timestamp issued or observed so far."""
        return self._last

    def now(self) -> int:
        """A fresh timestamp, larger than every one issued or observed before."""
        pt = self.wall()
        if pt > physical(self._last):
            self._last = pack(pt, 0)
        else:
            self._last = self._bump(self._last)
        return self._last

    def check(self, remote: int) -> None:
        """Raise :class:`ClockDriftError` if ``remote`` is too far ahead of our wall clock."""
        pt = self.wall()
        if physical(remote) - pt > self.max_drift_ms:
            raise ClockDriftError(remote, pt, self.max_drift_ms)

    def observe(self, remote: int) -> int:
        """Fold a remote timestamp in; return the new local timestamp."""
        self.check(remote)
        pt = self.wall()
        top = max(self._last, remote)
        self._last = pack(pt, 0) if pt > physical(top) else self._bump(top)
        return self._last

    @staticmethod
    def _bump(ts: int) -> int:
        # Logical overflow borrows a millisecond rather than wrapping: order is kept.
        if logical(ts) == LOGICAL_MASK:
            return pack(physical(ts) + 1, 0)
        return ts + 1

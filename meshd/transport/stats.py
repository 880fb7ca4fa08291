"""Counters of what a node's sockets dropped, by socket and reason."""

from __future__ import annotations

from collections import Counter, defaultdict


class DropCounters:
    """``counters[socket][reason] -> n``; reasons: oversized, malformed, unexpected,
    wrong_cluster, clock_drift, shape."""

    def __init__(self) -> None:
        self._c: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def add(self, socket: str, reason: str, n: int = 1) -> None:
        """Count ``n`` dropped frames on ``socket`` for ``reason``."""
        self._c[socket][reason] += n

    def get(self, socket: str, reason: str) -> int:
        """How many frames ``socket`` dropped for ``reason``."""
        return self._c[socket][reason]

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain copy for JSON."""
        return {s: dict(c) for s, c in self._c.items()}

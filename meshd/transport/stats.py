"""Counters of what a node's sockets dropped, by socket and reason."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable


class DropCounters:
    """``counters[socket][reason] -> n``; reasons: oversized, malformed, unexpected,
    wrong_cluster, clock_drift, shape."""

    def __init__(self, on_add: Callable[[str, str, int], None] | None = None) -> None:
        self._c: defaultdict[str, Counter[str]] = defaultdict(Counter)
        #: Told of every count too (the node mirrors them into /metrics).
        self._on_add = on_add

    def add(self, socket: str, reason: str, n: int = 1) -> None:
        """Count ``n`` dropped frames on ``socket`` for ``reason``."""
        self._c[socket][reason] += n
        if self._on_add is not None:
            self._on_add(socket, reason, n)

    def get(self, socket: str, reason: str) -> int:
        """How many frames ``socket`` dropped for ``reason``."""
        return self._c[socket][reason]

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain copy for JSON."""
        return {s: dict(c) for s, c in self._c.items()}

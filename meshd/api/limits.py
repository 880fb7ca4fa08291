"""Admission: how many completion requests one node's API carries at once.

Past :attr:`Admission.limit` a request gets a 429 with ``Retry-After`` at once rather
than a place in an unbounded queue: the client (the ``openai`` one retries 429s by
itself) backs off, and the requests already admitted keep their latency.
"""

from __future__ import annotations

__all__ = ["Admission", "Ticket"]


class Ticket:
    """One admitted request; :meth:`release` is idempotent."""

    __slots__ = ("_admission", "_held")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = True

    def release(self) -> None:
        """Give the slot back (once; later calls do nothing)."""
        if self._held:
            self._held = False
            self._admission.in_flight -= 1


class Admission:
    """A counter of requests in flight with a hard limit (event-loop confined)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the request limit must be at least 1")
        self.limit = limit
        self.in_flight = 0

    def enter(self) -> Ticket | None:
        """A ticket for one more request, or ``None`` when the node is full."""
        if self.in_flight >= self.limit:
            return None
        self.in_flight += 1
        return Ticket(self)

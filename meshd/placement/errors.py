"""Why a model cannot be placed: one typed error with a machine-readable reason."""

from __future__ import annotations

from typing import Literal

Reason = Literal[
    "no_nodes", "no_backend", "insufficient_memory", "unknown_node", "bad_spec",
    "too_many_replicas",
]  # fmt: skip

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


class PlacementError(Exception):
    """A plan that cannot be made, and why.

    ``reason`` is a short code:

    - ``no_nodes``: no live node at all, or fewer than ``spec.min_nodes``;
    - ``no_backend``: no node (or not enough, or a pinned one) runs an engine the
      model can use;
    - ``insufficient_memory``: the candidates do not hold the model; ``shortfalls``
      maps each node found short to the bytes it lacks;
    - ``unknown_node``: ``spec.nodes`` names a node that is not live;
    - ``bad_spec``: the spec or the model facts are inconsistent;
    - ``too_many_replicas``: fewer nodes can hold the model than the replicas asked
      for (replicas of one request never share a node).

    ``message`` (also ``str(err)``) says it for a person, naming the node(s) and the
    bytes short.
    """

    def __init__(self, reason: Reason, message: str, shortfalls: dict[str, int] | None = None):
        super().__init__(message)
        self.reason: Reason = reason
        self.message = message
        self.shortfalls: dict[str, int] = dict(shortfalls or {})

    def __reduce__(  # keep reason and shortfalls through pickling
        self,
    ) -> tuple[type[PlacementError], tuple[Reason, str, dict[str, int]]]:
        return (type(self), (self.reason, self.message, self.shortfalls))

    def __repr__(self) -> str:
        return f"PlacementError({self.reason!r}, {self.message!r}, {self.shortfalls!r})"


def fmt_bytes(n: int) -> str:
    """``1288490188`` -> ``1.2 GiB``: one decimal, binary units."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{n} B"

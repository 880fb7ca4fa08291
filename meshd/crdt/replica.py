"""A node's replica: the LWW-map, the node's HLC and the rules for accepting remote entries.

Still pure logic (the clock's wall source is injectable); the transport feeds it entries
and publishes what it returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from .hlc import HLC, ClockDriftError
from .lww import Entry, LWWMap
from .views import HEALTH, NODE, encode

#: Key spaces that only the node named in the key may write.
OWNER_ONLY = (NODE, HEALTH)


class DuplicateNodeIdError(RuntimeError):
    """Another live process writes under this node's id."""


@dataclass
class MergeResult:
    """What a batch of remote entries did to the replica."""

    changed: list[Entry] = field(default_factory=list)
    #: Entries refused, by reason: ``clock_drift``, ``foreign_owner``, ``below_horizon``.
    refused: dict[str, int] = field(default_factory=dict)

    def refuse(self, reason: str) -> None:
        """Count one refused entry."""
        self.refused[reason] = self.refused.get(reason, 0) + 1


class Replica:
    """The cluster state as one node holds it, plus that node's clock."""

    def __init__(self, node_id: str, clock: HLC | None = None) -> None:
        self.node_id = node_id
        self.clock = clock or HLC()
        self.map = LWWMap()
        #: Entries stamped before this are from an earlier run of this node id.
        self.started_hlc = self.clock.now()

    def write(self, key: str, value: msgspec.Struct) -> Entry:
        """Write a typed value under ``key`` as this node; return the entry to publish."""
        return self.map.put(key, encode(value), self.clock.now(), self.node_id)

    def delete(self, key: str) -> Entry:
        """Delete ``key`` as this node; return the tombstone to publish."""
        return self.map.delete(key, self.clock.now(), self.node_id)

    def merge_remote(self, entries: Iterable[Entry]) -> MergeResult:
        """Fold in entries from a peer, refusing the ones that break the rules.

        Raises :class:`DuplicateNodeIdError` when an entry newer than this node's start
        claims to be written by this node and is not one of its own writes.
        """
        res = MergeResult()
        for e in entries:
            try:
                self.clock.check(e.hlc)
            except ClockDriftError:
                res.refuse("clock_drift")
                continue
            if e.key.startswith(OWNER_ONLY) and e.key.split("/", 1)[1] != e.writer:
                res.refuse("foreign_owner")
                continue
            before = self.map.rejected_below_horizon
            if self.map.merge(e):
                if e.writer == self.node_id and e.hlc >= self.started_hlc:
                    raise DuplicateNodeIdError(
                        f"entry {e.key!r} at {e.hlc} was written under this node's id "
                        f"({self.node_id}) by another process"
                    )
                self.clock.observe(e.hlc)
                res.changed.append(e)
            elif self.map.rejected_below_horizon != before:
                res.refuse("below_horizon")
        return res

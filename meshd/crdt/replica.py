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


@dataclass
class MergeResult:
    """What a batch of remote entries did to the replica."""

    changed: list[Entry] = field(default_factory=list)
    #: Entries refused, by reason: ``clock_drift``, ``foreign_owner``, ``below_horizon``,
    #: ``own_id``.
    refused: dict[str, int] = field(default_factory=dict)
    #: Keys someone else wrote under this node's id: to be re-stamped by this node.
    reassert: list[str] = field(default_factory=list)

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

    def reassert(self, keys: Iterable[str]) -> list[Entry]:
        """Re-stamp this node's own entries for ``keys`` (a tombstone where it has none),
        newer than anything forged under its id; the entries to publish."""
        out = []
        for k in keys:
            cur = self.map.get(k)
            if cur is None or cur.value is None:
                out.append(self.map.delete(k, self.clock.now(), self.node_id))
            else:
                out.append(self.map.put(k, cur.value, self.clock.now(), self.node_id))
        return out

    def merge_remote(self, entries: Iterable[Entry]) -> MergeResult:
        """Fold in entries from a peer, refusing the ones that break the rules.

        An entry newer than this node's start that claims this node as its writer and
        is not one of its own writes (a forgery, or a second process with this id) is
        refused (``own_id``) and its key listed in :attr:`MergeResult.reassert`: peers
        may have taken it, and :meth:`reassert` out-stamps it. Nothing makes the node
        stop: one forged packet must not take a node down.
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
            if e.writer == self.node_id and e.hlc >= self.started_hlc:
                if self.map.get(e.key) != e:  # an echo of our own write is no news
                    res.refuse("own_id")
                    self.clock.observe(e.hlc)  # so a re-stamp out-ranks it
                    if e.key not in res.reassert:
                        res.reassert.append(e.key)
                continue
            before = self.map.rejected_below_horizon
            if self.map.merge(e):
                self.clock.observe(e.hlc)
                res.changed.append(e)
            elif self.map.rejected_below_horizon != before:
                res.refuse("below_horizon")
        return res

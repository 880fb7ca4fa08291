"""A node's replica: the LWW-map, the node's HLC and the rules for accepting remote entries.

Still pure logic (the clock's wall source is injectable); the transport feeds it entries
and publishes what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from .hlc import HLC, ClockDriftError
from .lww import Entry, LWWMap
from .views import HEALTH, MEMBER, NODE, encode

#: Key spaces that only the node named in the key may write.
OWNER_ONLY = (NODE, HEALTH)


class Trust(Protocol):
    """What a replica accepts from the network beyond the LWW rules: signatures,
    membership, the shape and size of keys and values (the node supplies it)."""

    def refusal(self, e: Entry, m: LWWMap) -> str | None:
        """Why ``e`` is refused given the state ``m``, or None to take it."""
        ...


@dataclass
class MergeResult:
    """What a batch of remote entries did to the replica."""

    changed: list[Entry] = field(default_factory=list)
    #: Entries refused, by reason: ``clock_drift``, ``foreign_owner``, ``below_horizon``,
    #: ``own_id``.
    refused: dict[str, int] = field(default_factory=dict)
    #: Keys someone else wrote under this node's id: to be re-stamped by this node.
    reassert: list[str] = field(default_factory=list)
    #: The ``own_id`` entries themselves (newer than anything this process wrote for
    #: their key): a forgery, or a second live process with this node's id.
    clashes: list[Entry] = field(default_factory=list)
    #: True if a peer had forgotten this node (tombstoned its card or heartbeat after a
    #: long silence); the keys are in :attr:`reassert`, so the node re-announces itself.
    evicted: bool = False

    def refuse(self, reason: str) -> None:
        """Count one refused entry."""
        self.refused[reason] = self.refused.get(reason, 0) + 1


def _space(key: str) -> str:
    return key[: key.find("/") + 1]


def owner_of(key: str) -> str | None:
    """The node a ``node/`` or ``health/`` key belongs to; None for other key spaces."""
    if key.startswith(OWNER_ONLY):
        return key.split("/", 1)[1]
    return None


class Replica:
    """The cluster state as one node holds it, plus that node's clock."""

    def __init__(
        self,
        node_id: str,
        clock: HLC | None = None,
        *,
        signer: Callable[[Entry], Entry] | None = None,
        trust: Trust | None = None,
    ) -> None:
        self.node_id = node_id
        self.clock = clock or HLC()
        self.map = LWWMap()
        #: Signs this node's writes (None in an open cluster).
        self.signer = signer
        #: Judges remote entries beyond the LWW rules (None: take what LWW takes).
        self.trust = trust
        #: Entries stamped before this are from an earlier run of this node id.
        self.started_hlc = self.clock.now()
        #: The last entry this process wrote, per key: what an echo is compared with.
        self._written: dict[str, Entry] = {}

    def _record(self, e: Entry) -> Entry:
        self._written[e.key] = e
        return e

    def _stamp(self, key: str, value: bytes | None) -> Entry:
        e = Entry(key, self.clock.now(), self.node_id, value)
        if self.signer is not None:
            e = self.signer(e)
        self.map.merge(e)
        return self._record(e)

    def write(self, key: str, value: msgspec.Struct) -> Entry:
        """Write a typed value under ``key`` as this node; return the entry to publish."""
        return self._stamp(key, encode(value))

    def delete(self, key: str) -> Entry:
        """Delete ``key`` as this node; return the tombstone to publish."""
        return self._stamp(key, None)

    def install(self, entries: Iterable[Entry]) -> int:
        """Take entries from a source already trusted (this node's own saved state, the
        package a member sent at the join), past the trust rules; how many changed."""
        return sum(1 for e in entries if self.map.merge(e, exempt=True))

    def written(self, key: str) -> Entry | None:
        """The last entry this process wrote for ``key`` (None if it never did)."""
        return self._written.get(key)

    def reassert(self, keys: Iterable[str]) -> list[Entry]:
        """Re-stamp this node's own entries for ``keys`` (a tombstone where it has none),
        newer than anything forged under its id; the entries to publish."""
        out = []
        for k in keys:
            cur = self.map.get(k)
            out.append(self._stamp(k, None if cur is None else cur.value))
        return out

    def is_echo(self, e: Entry) -> bool:
        """True if ``e``, written under this node's id in this run, sorts at or below the
        last entry this process wrote for its key: an echo (a heartbeat n-1 coming back
        in a Welcome or a pull reply), harmless since our newer write beats it anywhere."""
        last = self._written.get(e.key)
        return last is not None and e.order() <= last.order()

    def merge_remote(self, entries: Iterable[Entry]) -> MergeResult:
        """Fold in entries from a peer, refusing the ones that break the rules.

        * A clock too far ahead of ours is refused (``clock_drift``), never adopted.
        * A ``node/`` or ``health/`` value not written by the node in its key is refused
          (``foreign_owner``). A *tombstone* there is a survivor forgetting a node that
          was silent too long: taken, unless it names this node, which is alive and
          re-announces itself (the key goes to :attr:`MergeResult.reassert`).
        * An entry under this node's id, from this run, is either an echo of our own
          write (ignored, not counted) or sorts above everything we wrote for that key:
          a forgery or a second process with our id. That one is refused (``own_id``),
          listed in :attr:`MergeResult.clashes` for the node to investigate, and its key
          in :attr:`MergeResult.reassert`: peers may have taken it, :meth:`reassert`
          out-stamps it. Nothing here makes the node stop: one forged packet must not
          take a node down.
        * A node's own card or heartbeat is exempt from the GC horizon: only its node
          writes it, and a node that ran alone (or was forgotten and comes back) must be
          seen whatever the age of its card.
        """
        res = MergeResult()
        entries = list(entries)
        refused: dict[int, str] = {}
        if self.trust is not None:
            # Member entries first, as long as any is taken: one in a batch (a welcome,
            # a pull reply) may be approved by a member whose own entry comes with it.
            pending = [i for i, e in enumerate(entries) if e.key.startswith(MEMBER)]
            while pending:
                left = []
                for i in pending:
                    why = self.trust.refusal(entries[i], self.map)
                    if why is None:
                        refused.pop(i, None)
                        self._merge_one(entries[i], res)
                    else:
                        refused[i] = why
                        left.append(i)
                if len(left) == len(pending):
                    break
                pending = left
        # Cards and heartbeats before the rest: a plan is checked against the cards of
        # the nodes it names, which may come in the same batch.
        rank = {MEMBER: 0, NODE: 1, HEALTH: 1}
        order = sorted(range(len(entries)), key=lambda i: rank.get(_space(entries[i].key), 2))
        for i in order:
            e = entries[i]
            if i in refused:
                res.refuse(refused[i])
            elif not (self.trust is not None and e.key.startswith(MEMBER)):
                if self.trust is not None:
                    why = self.trust.refusal(e, self.map)
                    if why is not None:
                        res.refuse(why)
                        continue
                self._merge_one(e, res)
        return res

    def _merge_one(self, e: Entry, res: MergeResult) -> None:
        """The clock, LWW and ownership rules for one entry that passed the trust rules."""
        try:
            self.clock.check(e.hlc)
        except ClockDriftError:
            res.refuse("clock_drift")
            return
        owner = owner_of(e.key)
        if owner is not None and owner != e.writer:
            if e.value is not None:
                res.refuse("foreign_owner")
                return
            if owner == self.node_id:
                cur = self.map.get(e.key)
                if cur is not None and e.order() <= cur.order():
                    return  # forgotten before our last word: already answered
                self.clock.observe(e.hlc)  # so the re-stamp out-ranks the tombstone
                res.evicted = True
                if e.key not in res.reassert:
                    res.reassert.append(e.key)
                return
        if e.writer == self.node_id and e.hlc >= self.started_hlc:
            if self.is_echo(e):
                return
            res.refuse("own_id")
            res.clashes.append(e)
            self.clock.observe(e.hlc)  # so a re-stamp out-ranks it
            if e.key not in res.reassert:
                res.reassert.append(e.key)
            return
        before = self.map.rejected_below_horizon
        if self.map.merge(e, exempt=owner is not None and owner == e.writer):
            self.clock.observe(e.hlc)
            res.changed.append(e)
        elif self.map.rejected_below_horizon != before:
            res.refuse("below_horizon")

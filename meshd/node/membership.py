"""Who is in the cluster: liveness from heartbeats, forgetting the silent, and the
tombstone-collection horizon that every member has agreed to.

* Every heartbeat merged from the network is a beat of :class:`~meshd.crdt.Liveness`;
  every card points the gossip sockets at its node (:class:`~.peers.Peers`).
* A tick (every :data:`TICK_S`) reads each node's liveness; a transition is logged and
  wakes whoever waits on the cluster (:class:`~.changes.Changes`), and a node back from
  the dead is pulled from at once.
* A node dead or gone for ``forget_after`` is forgotten: its card and heartbeat are
  tombstoned and it stops holding the horizon back.
* Tombstones below the members' stable horizon (less a grace for clock skew) are
  collected, never by a node alone (it has agreed nothing with anyone).
"""

from __future__ import annotations

import asyncio
import logging
import time

from meshd.crdt import stable_horizon
from meshd.crdt.hlc import pack
from meshd.crdt.lww import Entry
from meshd.crdt.views import (
    HEALTH,
    MEMBER,
    NODE,
    Health,
    NodeCard,
    cards,
    decode,
    health_key,
    healths,
)
from meshd.crdt.views import node_key as card_key
from meshd.transport.gossip import Gossip

from .changes import Changes
from .peers import Peers
from .state import ClusterState

__all__ = ["TICK_S", "Membership"]

log = logging.getLogger("meshd.node")

#: How often liveness is read for transitions: the granularity of suspect/dead.
TICK_S = 0.2


class Membership:
    """Liveness, forgetting and tombstone collection for one node."""

    def __init__(
        self,
        state: ClusterState,
        gossip: Gossip,
        peers: Peers,
        *,
        dead_after: float,
        forget_after: float,
        tombstone_grace_ms: int,
    ) -> None:
        self.state = state
        self.gossip = gossip
        self.peers = peers
        self.dead_after = dead_after
        self.forget_after = forget_after
        self.tombstone_grace_ms = tombstone_grace_ms
        self._seen: dict[str, str] = {}
        #: Nodes with a card but no heartbeat yet -> since when (monotonic).
        self._unheard: dict[str, float] = {}
        #: What of each node's heartbeat matters to others: its state and runners.
        self._topology: dict[str, tuple[str, list]] = {}

    @property
    def changes(self) -> Changes:
        return self.state.changes

    # -- news from the network -----------------------------------------------------
    def on_entries(self, changed: list[Entry]) -> bool:
        """Take merged entries: heartbeats beat liveness, cards point the sockets.

        True when the topology changed (a card, or a heartbeat whose state or runners
        differ from the last one): waiters on the cluster should look again.
        """
        now = time.monotonic()
        me = self.state.node_id
        moved = False
        for e in changed:
            if e.key.startswith(HEALTH):
                nid = e.key[len(HEALTH) :]
                if e.value is None or nid == me:
                    continue
                h = decode(e.value, Health)
                if h is None:
                    continue
                self.state.liveness.beat(nid, e.hlc, now, stopped=h.state == "stopped")
                shape = (h.state, h.runners)
                if self._topology.get(nid) != shape:
                    self._topology[nid] = shape
                    moved = True
            elif e.key.startswith(NODE):
                moved = True
                nid = e.key[len(NODE) :]
                card = decode(e.value, NodeCard) if e.value is not None else None
                if card is not None and nid != me and card.id == nid:
                    self.peers.point_at(nid, card)
        return moved

    # -- the tick ------------------------------------------------------------------
    async def run(self) -> None:
        """Read liveness every :data:`TICK_S`; forget the silent; collect tombstones."""
        while True:
            await asyncio.sleep(TICK_S)
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        """One round: transitions, forgetting, collection."""
        liveness = self.state.liveness
        moved = False
        for nid in liveness.nodes():
            st = liveness.state(nid, now) or "unknown"
            before = self._seen.get(nid)
            if before == st:
                continue
            moved = True
            if before is not None or st != "alive":
                log.info("node %s is %s", self.peers.label(nid), st)
            if st == "alive" and before in ("dead", "left"):
                # Back from a partition or a restart: reconcile state now rather than
                # at the next digest.
                self.peers.tasks.spawn(self.gossip.pull(nid))
            self._seen[nid] = st
        self.forget_silent(now)
        self.collect_tombstones()
        if moved:
            self.changes.notify()

    # -- members -------------------------------------------------------------------
    def members(self, now: float | None = None) -> list[str]:
        """Nodes that count for tombstone collection: known, not gone for good (left),
        not forgotten (silent longer than ``forget_after``)."""
        now = time.monotonic() if now is None else now
        me = self.state.node_id
        liveness = self.state.liveness
        return [
            n for n in cards(self.state.map)
            if n == me or (liveness.state(n, now) != "left" and not self.forgotten(n, now))
        ]  # fmt: skip

    def forgotten(self, nid: str, now: float) -> bool:
        """True if ``nid`` has been dead or left (or, with a card, never heard) for
        longer than ``forget_after``. A dead member's frozen ``synced`` would otherwise
        hold the GC horizon back forever, and its card would stay listed forever."""
        liveness = self.state.liveness
        st = liveness.state(nid, now)
        if st is None:
            # A card that never came with a heartbeat: silent since we first saw it.
            since = self._unheard.setdefault(nid, now)
            return now - since > self.dead_after + self.forget_after
        self._unheard.pop(nid, None)
        silent = liveness.age(nid, now) or 0.0
        if st == "dead":
            return silent > self.dead_after + self.forget_after  # dead since dead_after
        return st == "left" and silent > self.forget_after

    def forget_silent(self, now: float) -> None:
        """Tombstone the card and heartbeat of every forgotten node and stop dialling it.

        Every survivor decides on its own clock and writes its own tombstones; LWW makes
        the concurrent deletes one, and a key already deleted is left alone, so this is
        idempotent. A forgotten node that comes back re-announces itself: its heartbeats
        are newer than the tombstones, and seeing its card deleted it re-stamps it.
        """
        replica = self.state.replica
        tombs: list[Entry] = []
        for nid in cards(replica.map):
            if nid == self.state.node_id or not self.forgotten(nid, now):
                continue
            log.info(
                "forgetting node %s: gone for more than %g s",
                self.peers.label(nid), self.forget_after,
            )  # fmt: skip
            for key in (card_key(nid), health_key(nid)):
                if key in replica.map:
                    tombs.append(replica.delete(key))
            self.peers.forget(nid)
            self._unheard.pop(nid, None)
            self._topology.pop(nid, None)
        self.state.publish(tombs)

    def forget_removed(self, gone: set[str]) -> None:
        """Members removed: their card and heartbeat go at once (no waiting for them to
        fall silent), and they stop counting for tombstone collection."""
        replica = self.state.replica
        tombs = [
            replica.delete(key)
            for nid in sorted(gone)
            for key in (card_key(nid), health_key(nid))
            if replica.map.value(key) is not None
        ]
        for nid in gone:
            self.peers.forget(nid)
            self._unheard.pop(nid, None)
            self._topology.pop(nid, None)
            self.gossip.synced_from.pop(nid, None)
        self.state.publish(tombs)
        self.changes.notify()

    def synced(self) -> int:
        """Our horizon: the oldest clock of a member whose whole state we hold."""
        peers = [n for n in self.members() if n != self.state.node_id]
        if not peers:
            return self.state.replica.clock.now()
        return min(self.gossip.synced_from.get(p, 0) for p in peers)

    def collect_tombstones(self) -> None:
        """Drop tombstones every member has seen (below the stable horizon, less grace)."""
        replica = self.state.replica
        hs = healths(replica.map)
        members = self.members()
        if len(members) < 2:
            # A lone node has agreed nothing with anyone: a horizon it set alone would
            # refuse the older entries of every node it meets later (the seed it could
            # not reach yet), so it keeps its tombstones until it has company.
            return
        # A member's published clock cannot be ahead of ours by more than drift, and
        # taking it past our own now would let one bad heartbeat collect live deletes.
        now = replica.clock.now()
        me = self.state.node_id
        synced = {n: min(hs[n].synced, now) if n in hs else 0 for n in members if n != me}
        synced[me] = self.synced()
        # The grace keeps the horizon behind every member's wall clock, so a peer whose
        # clock runs a little slow never writes below it.
        stable = stable_horizon(synced) - pack(self.tombstone_grace_ms, 0)
        # A member's tombstone is its revocation: kept for good, or an old copy of its
        # approval would be news again once the delete was collected.
        dropped = replica.map.collect(stable, members, keep=(MEMBER,))
        if dropped:
            log.debug("collected %d tombstones", dropped)

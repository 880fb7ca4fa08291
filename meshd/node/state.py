"""This node's replica of the shared map: its writes, and views of it for queries.

A write goes into the replica at once and is published as a delta; the node hears of
each (a new plan: its runners reconcile; a new member: its sockets admit it). Views
(:class:`~meshd.node.cluster.ClusterView`) are decoded snapshots with each node's
liveness read on this node's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from meshd.crdt.liveness import Liveness
from meshd.crdt.lww import Entry, LWWMap
from meshd.crdt.replica import Replica

from .changes import Changes
from .cluster import ClusterView
from .tasks import Tasks

__all__ = ["ClusterState"]


class ClusterState:
    """The replica, the liveness of its nodes, and what happens on a local write."""

    def __init__(
        self,
        replica: Replica,
        liveness: Liveness,
        *,
        publish: Callable[[list[Entry]], Coroutine[Any, Any, None]],
        changes: Changes,
        tasks: Tasks,
        on_write: Callable[[Entry], None],
    ) -> None:
        self.replica = replica
        self.liveness = liveness
        self.changes = changes
        self._publish = publish
        self._tasks = tasks
        self._on_write = on_write

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self.replica.node_id

    @property
    def map(self) -> LWWMap:
        """The LWW map itself (for digests and counts)."""
        return self.replica.map

    def view(self) -> ClusterView:
        """The cluster as of now."""
        return ClusterView.build(self.replica.map, self.node_id, self.liveness, time.monotonic())

    def is_live(self, nid: str) -> bool:
        """Alive or suspect now (this node always is)."""
        return nid == self.node_id or self.liveness.is_live(nid, time.monotonic())

    def is_alive(self, nid: str) -> bool:
        """Alive now, not even suspect (this node always is)."""
        return nid == self.node_id or self.liveness.state(nid, time.monotonic()) == "alive"

    def write(self, key: str, value: msgspec.Struct) -> Entry:
        """Write ``key`` here and publish it."""
        return self._written(self.replica.write(key, value))

    def delete(self, key: str) -> Entry:
        """Tombstone ``key`` here and publish it."""
        return self._written(self.replica.delete(key))

    async def write_now(self, key: str, value: msgspec.Struct) -> Entry:
        """Write ``key`` here and publish it before returning (a heartbeat, a goodbye)."""
        e = self.replica.write(key, value)
        await self._publish([e])
        return e

    def publish(self, entries: list[Entry]) -> None:
        """Publish entries already in the replica (fire and forget)."""
        if entries:
            self._tasks.spawn(self._publish(entries))

    def _written(self, e: Entry) -> Entry:
        self.publish([e])
        self._on_write(e)
        return e

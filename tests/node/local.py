"""One node's state in this process, on real ZeroMQ sockets bound to loopback: for the
fast tests of the node's parts (no subprocess, no HTTP).

Entries "from the network" are written by a replica of another node id and merged the
way gossip merges them, then handed to the part under test.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq.asyncio

from meshd.crdt.hlc import HLC
from meshd.crdt.liveness import Liveness
from meshd.crdt.lww import Entry
from meshd.crdt.replica import Replica
from meshd.node.changes import Changes
from meshd.node.state import ClusterState
from meshd.node.tasks import Tasks
from meshd.transport import wire
from meshd.transport.gossip import Gossip


@dataclass
class Local:
    """A node's replica, gossip sockets and state, without the rest of the node."""

    state: ClusterState
    gossip: Gossip
    tasks: Tasks
    ctx: zmq.asyncio.Context
    #: Every entry this node wrote (what the node reacts to: reconcile, new members).
    written: list[Entry] = field(default_factory=list)
    _others: dict[str, Replica] = field(default_factory=dict)

    def from_peer(self, nid: str, key: str, value: msgspec.Struct | None) -> Entry:
        """Write ``key`` as node ``nid`` and merge it here, as gossip would."""
        r = self._others.setdefault(nid, Replica(nid, HLC()))
        e = r.write(key, value) if value is not None else r.delete(key)
        self.state.replica.merge_remote([e])
        return e


@contextlib.asynccontextmanager
async def local_node(
    node_id: str = "a", *, suspect_after: float = 1.2, dead_after: float = 2.0
) -> AsyncIterator[Local]:
    """A :class:`Local` node, torn down (tasks, sockets, context) at the end."""
    ctx = zmq.asyncio.Context()
    replica = Replica(node_id, HLC())
    tasks = Tasks()
    gossip = Gossip(
        replica,
        ctx=ctx,
        cluster=wire.cluster_hash("local-test"),
        incarnation="i",
        own_entries=list,
        on_change=lambda changed: None,
        bind_host="127.0.0.1",
    )
    local: Local
    state = ClusterState(
        replica,
        Liveness(suspect_after, dead_after),
        publish=gossip.publish,
        changes=Changes(),
        tasks=tasks,
        on_write=lambda e: local.written.append(e),
    )
    local = Local(state, gossip, tasks, ctx)
    try:
        yield local
    finally:
        await tasks.close()
        await gossip.stop()
        ctx.term()

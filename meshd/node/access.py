"""Who this node lets in: its cluster's keys, the members its sockets admit, the join
desk where new nodes ask, and the member entries it keeps on disk.

An open cluster (``--open``) has none of this: :class:`Access` is then a no-op that
says once, loudly, that anyone on the LAN can join and read the traffic.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from meshd.crdt.lww import Entry
from meshd.crdt.replica import Replica, Trust
from meshd.crdt.views import MEMBER, Member, member_key
from meshd.transport.identity import NodeKey, member_proof, sign_entry
from meshd.transport.security import ClusterKeys, HandshakeReporter, cluster_keys, start_zap
from meshd.transport.stats import DropCounters

from .cluster_store import ClusterStore, StoredCluster
from .join_client import ask_to_join
from .join_desk import JoinDesk
from .joining import Refusals
from .plans import refuse_plan_entry
from .state import ClusterState
from .tasks import Tasks
from .trust import ClusterTrust, member_curve_keys

__all__ = ["Access"]

log = logging.getLogger("meshd.node")

#: Member entries are written to disk at most this often.
_SAVE_EVERY_S = 1.0


class Access:
    """The keys and the membership of one node (``cluster`` None: an open cluster)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        cluster: StoredCluster | None,
        key: NodeKey,
        store: ClusterStore,
        counters: DropCounters,
    ) -> None:
        self.cluster = cluster
        self.key = key
        self.store = store
        self._counters = counters
        #: The CurveZMQ client keys (Z85) the ZAP handler admits, changed in place.
        self.admitted: set[bytes] = set()
        self.keys: ClusterKeys | None = None
        self.zap: Any = None
        self.desk: JoinDesk | None = None
        #: Whom the join desk and ZAP turned away, by address (``meshctl doctor``).
        self.refusals = Refusals()
        self._save_pending = False
        self._on_members: list[Callable[[list[bytes]], None]] = []
        #: This node's name (as it asks to be let in).
        self.name = key.node_id
        if cluster is None:
            log.warning(
                "OPEN cluster (--open): gossip and activations travel in clear and any "
                "machine on the LAN can join, place models and read prompts"
            )
            return
        self.keys = cluster_keys(cluster.key, key.curve_pair())
        self.admitted.add(self.keys.client_public)
        reporter = HandshakeReporter(counters.add)
        self.zap = start_zap(
            ctx, self.admitted.__contains__, lambda: reporter.denied("zap"),
            on_denied_at=lambda address: self.refusals.note(address, "zap_denied"),
        )  # fmt: skip
        log.info("cluster %r (%s): every socket admits its members only", cluster.name, cluster.id)

    @property
    def secured(self) -> bool:
        """Whether the cluster has keys (not ``--open``)."""
        return self.cluster is not None

    # -- the replica ---------------------------------------------------------------
    def replica_options(self) -> dict[str, Any]:
        """The signer and the trust rules a replica of this cluster is built with."""
        if self.cluster is None:
            # No keys, no members: the shape and the bounds of entries still hold.
            return {"trust": ClusterTrust(None)}
        trust: Trust = ClusterTrust(self.cluster.key, plans=refuse_plan_entry)
        return {"signer": functools.partial(sign_entry, self.key), "trust": trust}

    def install(self, replica: Replica, name: str) -> None:
        """Take the member entries kept on disk, and make sure this node's own is there
        (vouched for with the cluster key)."""
        self.name = name
        if self.cluster is None:
            return
        replica.install(self.cluster.members)
        mine = replica.map.value(member_key(self.key.node_id))
        if mine is None:
            replica.write(
                member_key(self.key.node_id),
                Member(
                    id=self.key.node_id, name=name, key=self.key.public, by=self.key.node_id,
                    at_ms=int(time.time() * 1000),
                    proof=member_proof(self.cluster.key, self.key.public),
                ),
            )  # fmt: skip
        self.refresh(replica)

    def on_members(self, listener: Callable[[list[bytes]], None]) -> None:
        """Call ``listener(admitted keys)`` whenever the members change."""
        self._on_members.append(listener)

    def refresh(self, replica: Replica) -> None:
        """The members changed: admit exactly them (and this node), tell the listeners."""
        if self.cluster is None or self.keys is None:
            return
        now = member_curve_keys(replica.map) | {self.keys.client_public}
        self.admitted.intersection_update(now)
        self.admitted.update(now)
        keys = sorted(self.admitted)
        for listener in self._on_members:
            listener(keys)

    def save_soon(self, replica: Replica, tasks: Tasks) -> None:
        """Write the member entries to disk shortly (a burst of changes is one write)."""
        if self.cluster is None or self._save_pending:
            return
        self._save_pending = True

        async def save() -> None:
            await asyncio.sleep(_SAVE_EVERY_S)
            self._save_pending = False
            members = list(replica.map.live(MEMBER))
            await asyncio.to_thread(self.store.save_members, members)

        tasks.spawn(save())

    # -- the join desk -------------------------------------------------------------
    def open_desk(
        self, ctx: zmq.asyncio.Context, state: ClusterState, name: str, host: str, port: int
    ) -> int:
        """Bind the join port; its port (0 in an open cluster)."""
        if self.cluster is None:
            return 0

        def write_member(m: Member) -> None:
            state.write(member_key(m.id), m)

        self.desk = JoinDesk(
            state, self.cluster, name, write_member=write_member,
            count=lambda reason: self._counters.add("join", reason), refusals=self.refusals,
        )  # fmt: skip
        return self.desk.bind(ctx, host, port)

    async def introduce(
        self, ctx: zmq.asyncio.Context, replica: Replica, host: str, join_port: int
    ) -> list[Entry] | None:
        """Vouch for this node at a peer's join desk (it holds the cluster key, so the
        peer admits it at once) and take the members the peer holds; the entries that
        changed here, or None when the peer did not answer yes. Bounded: one try."""
        if self.cluster is None or not join_port:
            return None
        proof = member_proof(self.cluster.key, self.key.public)
        try:
            outcome = await asyncio.wait_for(
                ask_to_join(ctx, self.key, self.name, lambda: [(host, join_port)], proof=proof),
                timeout=3.0,
            )
        except (TimeoutError, RuntimeError, zmq.ZMQError):
            return None
        return replica.merge_remote(outcome.cluster.members).changed

    def close(self) -> None:
        """Stop the ZAP handler."""
        if self.zap is not None:
            self.zap.stop()

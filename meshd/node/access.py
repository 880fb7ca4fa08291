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
from meshd.transport.identity import NodeKey, curve_public_of, member_proof, node_id_of, sign_entry
from meshd.transport.members import Members
from meshd.transport.security import CurveKeys, HandshakeReporter, start_zap
from meshd.transport.stats import DropCounters

from .cluster_store import ClusterStore, StoredCluster
from .join_client import ask_to_join, whois
from .join_desk import JoinDesk
from .joining import Refusals
from .plans import refuse_plan_entry
from .state import ClusterState
from .tasks import Tasks
from .trust import ClusterTrust, member_curves, member_entries, revoked

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
        #: The members' CurveZMQ keys: what ZAP and receive loops admit, and the key a
        #: socket dialling a member names. Changed in place.
        self.members = Members()
        self.keys: CurveKeys | None = None
        self.zap: Any = None
        self.desk: JoinDesk | None = None
        #: Whom the join desk and ZAP turned away, by address (``meshctl doctor``).
        self.refusals = Refusals()
        self._save_pending = False
        self._on_members: list[Callable[[dict[str, bytes]], None]] = []
        self._on_removed: list[Callable[[set[str]], None]] = []
        self._told_removed = False
        #: This node's name (as it asks to be let in).
        self.name = key.node_id
        if cluster is None:
            log.warning(
                "OPEN cluster (--open): gossip and activations travel in clear and any "
                "machine on the LAN can join, place models and read prompts"
            )
            return
        self.keys = CurveKeys(*key.curve_pair())
        self.members.replace({key.node_id: self.keys.public})
        reporter = HandshakeReporter(counters.add)
        self.zap = start_zap(
            ctx, self.members.admits, lambda: reporter.denied("zap"),
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
        trust: Trust = ClusterTrust(
            self.cluster.key, plans=refuse_plan_entry, self_vouch=self.cluster.self_vouch
        )
        return {"signer": functools.partial(sign_entry, self.key), "trust": trust}

    def install(self, replica: Replica, name: str) -> None:
        """Take the member entries kept on disk, and make sure this node's own is there:
        the first node of a cluster writes it (an owner), and in a secret-file cluster
        a node vouches for itself with the key."""
        self.name = name
        if self.cluster is None:
            return
        replica.install(self.cluster.members)
        nid = self.key.node_id
        if replica.map.value(member_key(nid)) is None:
            first = not any(True for _ in replica.map.live(MEMBER))
            if revoked(replica.map, nid):
                log.error(
                    "this node was removed from cluster %r: no member admits it. To join "
                    "again, a member approves it anew (meshd up with a fresh data dir)",
                    self.cluster.name,
                )  # fmt: skip
            elif first or self.cluster.self_vouch:
                proof = member_proof(self.cluster.key, self.key.public)
                replica.write(
                    member_key(nid),
                    Member(
                        id=nid, name=name, key=self.key.public, by=nid,
                        at_ms=int(time.time() * 1000), owner=first,
                        proof=proof if self.cluster.self_vouch else b"",
                    ),
                )  # fmt: skip
        self.refresh(replica)

    def on_members(self, listener: Callable[[dict[str, bytes]], None]) -> None:
        """Call ``listener(member id -> CURVE key)`` whenever the members change."""
        self._on_members.append(listener)

    def on_removed(self, listener: Callable[[set[str]], None]) -> None:
        """Call ``listener(ids)`` when members are removed: their live connections end."""
        self._on_removed.append(listener)

    def refresh(self, replica: Replica) -> None:
        """The members changed: admit exactly them (and this node), tell the listeners;
        the connections of members removed end."""
        if self.cluster is None or self.keys is None:
            return
        now = member_curves(replica.map)
        now[self.key.node_id] = self.keys.public
        gone = self.members.replace(now)
        for listener in self._on_members:
            listener(dict(now))
        if gone:
            log.warning("removed from the cluster: %s; their connections end now", sorted(gone))
            for removed in self._on_removed:
                removed(gone)
        if revoked(replica.map, self.key.node_id) and not self._told_removed:
            self._told_removed = True
            log.error("this node was removed from cluster %r by an owner", self.cluster.name)

    def save_soon(self, replica: Replica, tasks: Tasks) -> None:
        """Write the member entries to disk shortly (a burst of changes is one write)."""
        if self.cluster is None or self._save_pending:
            return
        self._save_pending = True

        async def save() -> None:
            await asyncio.sleep(_SAVE_EVERY_S)
            self._save_pending = False
            members = member_entries(replica.map)
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
            own_key=self.key.public,
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

    async def member_at(
        self, ctx: zmq.asyncio.Context, host: str, join_port: int
    ) -> tuple[str, bytes] | None:
        """The member that answers at ``host``'s join port, and the CURVE key to dial it
        with; None when none answers or it is no member here (nothing is sent to it)."""
        public = await whois(ctx, host, join_port)
        if public is None:
            return None
        nid = node_id_of(public)
        key = self.members.key_of(nid)
        if key is None or key != curve_public_of(public):
            log.debug("%s:%d is node %s, no member here", host, join_port, nid)
            return None
        return nid, key

    def close(self) -> None:
        """Stop the ZAP handler."""
        if self.zap is not None:
            self.zap.stop()

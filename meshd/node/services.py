"""What a node offers the API that runs beside it (``meshd.api.services.Services``).

The API never reaches into the node's parts: it asks these questions and calls these
operations, and maps the typed errors they raise to HTTP in one place.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec

import meshd
from meshd.crdt.views import Instance, InstanceSpec, member_key, members
from meshd.transport import wire
from meshd.transport.dataplane import DataPlane
from meshd.transport.gossip import Gossip
from meshd.transport.stats import DropCounters

from .access import Access
from .cluster import ClusterView
from .config import NodeConfig
from .instances import Instances
from .metrics import Metrics
from .presence import Presence
from .requests import Requests
from .state import ClusterState
from .supervisor import Supervisor

__all__ = ["MemberView", "NodeServices", "NotSecured", "PendingView", "Vitals"]


class NotSecured(Exception):
    """An open cluster has no members to approve or invite."""


class MemberView(msgspec.Struct, kw_only=True):
    """A member of the cluster."""

    id: str
    name: str
    #: Who approved it (its own id: it came with the cluster's key).
    by: str
    at_ms: int


class PendingView(msgspec.Struct, kw_only=True):
    """A node waiting at this node's join desk for approval."""

    id: str
    name: str
    waiting_s: float


class Vitals(msgspec.Struct, kw_only=True):
    """This node's own vitals and drop counters (the body of ``GET /healthz``)."""

    node: str
    name: str
    cluster: str
    version: str
    uptime_s: float
    mesh_port: int
    pub_port: int
    api_port: int
    #: Entries in the replica, and its root hash: equal on two nodes iff they hold
    #: the same state.
    entries: int
    digest: str
    data_port: int
    requests_in_flight: int
    secured: bool
    dropped: dict[str, dict[str, int]]
    #: The node is stopping: load balancers should send elsewhere.
    draining: bool


class NodeServices:
    """The node's side of the API boundary."""

    def __init__(
        self,
        *,
        config: NodeConfig,
        state: ClusterState,
        presence: Presence,
        gossip: Gossip,
        dataplane: DataPlane,
        instances: Instances,
        requests: Requests,
        supervisor: Supervisor,
        metrics: Metrics,
        counters: DropCounters,
        access: Access,
    ) -> None:
        self._config = config
        self._state = state
        self._presence = presence
        self._gossip = gossip
        self._dataplane = dataplane
        self._instances = instances
        self._requests = requests
        self._supervisor = supervisor
        self._counters = counters
        self._access = access
        self._started = time.monotonic()
        self.metrics = metrics

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self._state.node_id

    @property
    def cluster_name(self) -> str:
        """The cluster's name."""
        return self._config.cluster

    @property
    def draining(self) -> bool:
        """The node is stopping: new requests should go elsewhere."""
        return self._presence.draining

    def view(self) -> ClusterView:
        """The cluster as of now."""
        return self._state.view()

    def vitals(self) -> Vitals:
        """This node's own vitals."""
        return Vitals(
            node=self._state.node_id,
            name=self._config.name,
            cluster=self._config.cluster,
            version=meshd.__version__,
            uptime_s=round(time.monotonic() - self._started, 3),
            mesh_port=self._gossip.mesh_port,
            pub_port=self._gossip.pub_port,
            api_port=self._presence.card.api_port,
            entries=len(self._state.map),
            digest=f"{self._state.map.root():016x}",
            data_port=self._dataplane.port,
            requests_in_flight=self._requests.in_flight(),
            secured=self._access.secured,
            dropped=self._counters.snapshot(),
            draining=self._presence.draining,
        )

    def sync_metrics(self) -> None:
        """Copy gauges that live elsewhere into the metrics registry."""
        by_state: dict[str, int] = {}
        for r in self._supervisor.statuses():
            by_state[r.state] = by_state.get(r.state, 0) + 1
        for st in ("loading", "ready", "failed"):
            self.metrics.runners.labels(st).set(by_state.get(st, 0))

    async def instance_for(self, model: str) -> Instance:
        """The ready instance serving ``model``, placing one if needed (bounded wait)."""
        return await self._instances.instance_for(model)

    async def place(self, spec: InstanceSpec) -> Instance:
        """Place an instance as asked (checks the model can run where pinned)."""
        return await self._instances.place_requested(spec)

    def remove(self, instance_id: str) -> bool:
        """Delete an instance; False if there is none with that id."""
        return self._instances.remove(instance_id)

    # -- membership ------------------------------------------------------------------
    @property
    def secured(self) -> bool:
        """Whether the cluster has keys and members (not ``--open``)."""
        return self._access.secured

    def members(self) -> tuple[list[MemberView], list[PendingView]]:
        """The members, and the nodes waiting at this node's join desk."""
        desk = self._access.desk
        if desk is None:
            raise NotSecured("an open cluster (--open) has no members")
        ms = [
            MemberView(id=m.id, name=m.name, by=m.by, at_ms=m.at_ms)
            for m in sorted(members(self._state.map).values(), key=lambda m: (m.name, m.id))
        ]
        now = time.monotonic()
        pending = [
            PendingView(id=p.node_id, name=p.name, waiting_s=round(now - p.first_seen, 1))
            for p in desk.pending.values()
        ]
        return ms, pending

    def approve(self, ref: str) -> MemberView:
        """Let a pending node in (by name or id); LookupError when none or several match."""
        desk = self._access.desk
        if desk is None:
            raise NotSecured("an open cluster (--open) lets every node in")
        p = desk.approve(ref)
        return MemberView(id=p.node_id, name=p.name, by=self._state.node_id, at_ms=0)

    def invite(self) -> tuple[str, float]:
        """A pairing code for ``meshd up --join CODE`` and the seconds it stays good."""
        desk = self._access.desk
        if desk is None:
            raise NotSecured("an open cluster (--open) needs no invitation")
        return desk.invite()

    def remove_member(self, node_id: str) -> bool:
        """Revoke a member (its sockets are refused from then on); False if none."""
        if self._access.desk is None:
            raise NotSecured("an open cluster (--open) has no members")
        if node_id not in members(self._state.map):
            return False
        self._state.delete(member_key(node_id))
        return True

    def generate(
        self,
        inst: Instance,
        job: wire.Job,
    ) -> AsyncIterator[wire.DataChunk]:
        """Run one request on ``inst`` (see :meth:`Requests.generate`)."""
        return self._requests.generate(inst, job)

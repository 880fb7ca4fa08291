"""What a node offers the API that runs beside it (``meshd.api.services.Services``).

The API never reaches into the node's parts: it asks these questions and calls these
operations, and maps the typed errors they raise to HTTP in one place.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import msgspec
import zmq.asyncio

import meshd
from meshd.crdt.hlc import physical, wall_ms
from meshd.crdt.views import Instance, InstanceSpec, health_key, member_key, members
from meshd.domain.job import Job
from meshd.transport import wire
from meshd.transport.addresses import choose_address, interface_addresses, virtual_addresses
from meshd.transport.dataplane import DataPlane
from meshd.transport.gossip import Gossip
from meshd.transport.stats import DropCounters

from . import diagnosis as dx
from .access import Access
from .cluster import ClusterView
from .config import NodeConfig
from .dependencies import untested
from .instances import Instances
from .member_views import MemberView, NotOwner, NotSecured, PendingView, pending_view
from .metrics import Metrics
from .presence import Presence
from .probes import PROBE_TIMEOUT_S, Target, probe_all
from .requests import Requests
from .state import ClusterState
from .supervisor import Supervisor
from .trust import is_owner, member_by_ref
from .twins import Twins

if TYPE_CHECKING:  # zeroconf is imported only when discovery runs
    from meshd.transport.discovery import Discovery

__all__ = ["NodeServices", "Vitals"]


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
        twins: Twins | None = None,
        discovery: Callable[[], Discovery | None] = lambda: None,
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
        self._twins = twins
        #: The running Bonjour part, if any (it starts after the services are built).
        self._discovery = discovery
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

    async def changed(self, timeout: float) -> bool:
        """Until the cluster changes (True: a card, an instance, a runner's state, a
        liveness; see ``Changes``) or ``timeout`` seconds pass (False)."""
        return await self._state.changes.wait(timeout)

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
        for st in ("fetching", "loading", "ready", "failed"):
            self.metrics.runners.labels(st).set(by_state.get(st, 0))
        for (iid, stage), runner in self._supervisor.runners.items():
            if runner.proposed:
                self.metrics.proposed.labels(iid).set(runner.proposed)
            if stage == 0:
                self.metrics.stage_queue.labels(iid).set(runner.waiting)
                for figure, n in zip(("calls", "steps", "widest"), runner.prefills, strict=True):
                    self.metrics.prefills.labels(iid, figure).set(n)
        self.metrics.queued.set(len(self._requests.queued))
        m, sup = self.metrics, self._supervisor
        for name, counter, counts in (("faults", m.stage_faults, sup.stage_faults),
                                      ("stalls", m.stage_stalls, sup.stalls)):  # fmt: skip
            seen = m.seen.setdefault(name, {})
            for iid, n in counts.items():
                if n > seen.get(iid, 0):
                    counter.labels(iid).inc(n - seen.get(iid, 0))
                    seen[iid] = n

    async def instance_for(self, model: str, context: int = 0) -> Instance:
        """The ready instance serving ``model``, placing one if needed (with ``context``
        tokens a request; 0: the default), with a bounded wait."""
        return await self._instances.instance_for(model, context=context)

    async def place(
        self, spec: InstanceSpec, replicas: int = 1, keep: bool = False
    ) -> list[Instance]:
        """Place ``replicas`` instances as asked, in place of the model's automatic
        one unless ``keep`` (checks the model can run where pinned)."""
        return await self._instances.place_requested(spec, replicas, keep)

    def remove(self, instance_id: str) -> bool:
        """Delete an instance; False if there is none with that id."""
        return self._instances.remove(instance_id)

    def instance_load(self) -> dict[str, int]:
        """Requests this node's API runs on each instance now, by instance id."""
        return dict(self._requests.load)

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
            MemberView.of(m)
            for m in sorted(members(self._state.map).values(), key=lambda m: (m.name, m.id))
        ]
        now = time.monotonic()
        pending = [pending_view(p, now) for p in desk.pending.values()]
        return ms, pending

    def approve(self, code: str, node: str = "") -> list[PendingView]:
        """Approve the waiting node whose screen shows ``code`` (``node``: its id or a
        prefix, optional); it is a member once it confirms the code. LookupError when
        ``code`` is no code or no waiting node shows it."""
        desk = self._access.desk
        if desk is None:
            raise NotSecured("an open cluster (--open) lets every node in")
        now = time.monotonic()
        return [pending_view(p, now) for p in desk.approve(code, node)]

    def invite(self) -> tuple[str, float]:
        """A pairing code for ``meshd up --join CODE`` and the seconds it stays good."""
        desk = self._access.desk
        if desk is None:
            raise NotSecured("an open cluster (--open) needs no invitation")
        return desk.invite()

    def remove_member(self, ref: str) -> MemberView:
        """Remove a member for good (``ref``: its id, a unique id prefix, or its name):
        every node ends its connections and refuses it from then on, across restarts.

        Raises :class:`NotSecured`, LookupError (no such member, or several), or
        :class:`NotOwner` (only an owner removes another member; every node's trust
        rules would refuse this node's removal otherwise).
        """
        if self._access.desk is None:
            raise NotSecured("an open cluster (--open) has no members")
        m = self._state.map
        held = members(m)
        target, me = member_by_ref(held, ref), held.get(self._state.node_id)
        if target.id != self._state.node_id and (me is None or not is_owner(m, me)):
            owners = ", ".join(x.name for x in held.values() if is_owner(m, x)) or "none"
            raise NotOwner(
                f"this node is no owner of the cluster, so it may not remove {target.name}; "
                f"run this on an owner's node ({owners})"
            )
        self._state.delete(member_key(target.id))
        return MemberView.of(target)

    def generate(
        self,
        inst: Instance,
        job: Job,
        keep_alive: float | None = None,
    ) -> AsyncIterator[wire.DataChunk]:
        """Run one request on ``inst`` (see :meth:`Requests.generate`)."""
        return self._requests.generate(inst, job, keep_alive=keep_alive)

    def keep_alive(self, instance_id: str, seconds: float | None) -> None:
        """See :meth:`Requests.keep_alive`."""
        self._requests.keep_alive(instance_id, seconds)

    # -- doctor --------------------------------------------------------------------
    async def doctor(self) -> dx.Report:
        """What is wrong here and how to fix it (``GET /v1/doctor``): the facts this node
        observed, each peer's ports probed from here (bounded, ~1.5 s), diagnosed."""
        view = self._state.view()
        ports = await probe_all(
            zmq.asyncio.Context.instance(), self._access.keys, self._probe_targets(view)
        )
        return dx.diagnose(self._snapshot(view, ports))

    def _probe_targets(self, view: ClusterView) -> list[Target]:
        """The mesh, PUB and data ports of every other node with a card, at the address
        this node dials it at (else the one it would choose)."""
        dialled = self._gossip.peers()
        own, virtual = self._presence.card.addresses, virtual_addresses()
        out: list[Target] = []
        for nid, card in sorted(view.cards.items(), key=lambda kv: (kv[1].name, kv[0])):
            if nid == view.self_id or view.liveness.get(nid) == "left" or not card.addresses:
                continue
            ep = dialled.get(nid)
            host = ep.host if ep else choose_address(own, card.addresses, ambiguous=virtual)
            for name, port in (
                ("mesh", card.mesh_port),
                ("pub", card.pub_port),
                ("data", card.data_port),
            ):
                if port:
                    out.append(Target(nid, name, host, port, self._access.members.key_of(nid)))
        return out

    def _snapshot(self, view: ClusterView, ports: list[dx.PortCheck]) -> dx.Snapshot:
        cfg, now = self._config, time.monotonic()
        disc = self._discovery()
        sightings = [] if disc is None else list(disc.sightings.values())
        desk = self._access.desk
        counts = self._counters.snapshot()
        entries = counts.get("entries", {})
        failed = {
            sock: sum(n for reason, n in by.items() if reason.startswith("handshake"))
            for sock, by in counts.items()
        }
        twins = [] if self._twins is None else list(self._twins.seen.values())
        cache = cfg.cache_dir
        disk = cache if cache.exists() else cfg.data_dir
        try:
            free: int | None = shutil.disk_usage(disk).free
        except OSError:
            free = None
        return dx.Snapshot(
            view=view,
            name=cfg.name,
            version=meshd.__version__,
            cluster=self._access.cluster.name if self._access.cluster else cfg.cluster,
            secured=self._access.secured,
            discovery="off" if not cfg.discovery else "on" if disc is not None else "failed",
            discovery_s=0.0 if disc is None or disc.started_at is None else now - disc.started_at,
            bonjour_peers=frozenset(disc.peers) if disc is not None else frozenset(),
            sightings=tuple(
                dx.Sighting(
                    node_id=x.node_id,
                    name=x.name,
                    host=x.host,
                    port=x.port,
                    cluster=x.cluster,
                    cluster_name=x.cluster_name,
                    version=x.version,
                    same_cluster=x.same_cluster,
                    age_s=now - x.seen,
                    present=x.present,
                )
                for x in sightings
            ),
            malformed_adverts=0 if disc is None else disc.malformed,
            seeds=tuple(f"{h}:{p}" for h, p in cfg.peers),
            refusals=tuple(
                dx.Refusal(
                    address=r.address,
                    reason=r.reason,
                    name=r.name,
                    node_id=r.node_id,
                    count=r.count,
                    age_s=now - r.last,
                )
                for r in self._access.refusals.recent()
            ),
            waiting=tuple(
                dx.Waiting(
                    node_id=p.node_id, name=p.name, address=p.address, waiting_s=now - p.first_seen
                )
                for p in (desk.pending.values() if desk is not None else ())
            ),
            handshake_failures={k: v for k, v in failed.items() if v},
            ports=tuple(ports),
            probe_timeout_s=PROBE_TIMEOUT_S,
            twins=tuple(
                dx.TwinSeen(name=t.name, address=t.address, age_s=now - t.at, confirmed=t.confirmed)
                for t in twins
            ),
            own_id_refused=entries.get("own_id", 0),
            clock_drift_refused=entries.get("clock_drift", 0),
            max_drift_ms=cfg.max_clock_drift_ms,
            clock_ahead_ms=self._clock_ahead(view),
            interfaces=tuple(dx.Interface(n, a, p) for n, a, p in interface_addresses()),
            advertised=tuple(self._presence.card.addresses),
            dialled={n: ep.host for n, ep in self._gossip.peers().items() if n[:1] != "@"},
            disk_path=str(disk),
            disk_free=free,
            untested=tuple(untested()),
        )

    def _clock_ahead(self, view: ClusterView) -> dict[str, int]:
        """How far each live peer's last heartbeat was stamped ahead of this node's wall
        clock when it arrived (its arrival: now less the heartbeat's age here)."""
        out: dict[str, int] = {}
        now = wall_ms()
        for nid, age in view.ages.items():
            e = self._state.map.get(health_key(nid))
            if nid == view.self_id or e is None or e.value is None or not view.is_live(nid):
                continue
            out[nid] = physical(e.hlc) - int(now - age * 1000)
        return out

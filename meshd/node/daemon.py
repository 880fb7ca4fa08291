"""The meshd daemon: one node's parts, built together, started together, stopped in order.

It holds no protocol logic of its own: the CRDT rules live in ``meshd.crdt``, the wire
in ``meshd.transport``, placement in ``meshd.placement``, the node's jobs in the modules
beside this one (:mod:`.membership`, :mod:`.peers`, :mod:`.twins`, :mod:`.presence`,
:mod:`.instances`, :mod:`.requests`, :mod:`.supervisor`). :meth:`Node.start` builds and
wires them; the node knows nothing of HTTP: ``meshd up`` (the composition root) serves
the API over :attr:`Node.services`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

import meshd
from meshd.crdt import Liveness
from meshd.crdt.hlc import HLC
from meshd.crdt.lww import Entry
from meshd.crdt.replica import Replica
from meshd.crdt.views import INSTANCE, MEMBER, instances
from meshd.engines.probe import probe
from meshd.models.inventory import held_models
from meshd.placement import fmt_bytes
from meshd.transport import wire
from meshd.transport.addresses import local_addresses, virtual_addresses
from meshd.transport.dataplane import DataPlane
from meshd.transport.gossip import Gossip
from meshd.transport.sockets import free_port_pair
from meshd.transport.stats import DropCounters

from . import sysinfo
from .access import Access
from .changes import Changes
from .cluster import ClusterView
from .cluster_store import ClusterStore, StoredCluster
from .config import NodeConfig
from .enrollment import enroll, join_port_of
from .identity import ID_FILE, Identity, load_identity
from .instances import Instances
from .membership import Membership
from .metrics import Metrics
from .peers import Peers
from .presence import Presence, cap_memory, first_card
from .requests import Requests
from .roots import ModelRoots
from .services import NodeServices
from .sleep import Sleep
from .state import ClusterState
from .supervisor import Supervisor, decode_bps, tell_drafts
from .supervisor_settings import SupervisorSettings
from .tasks import Tasks
from .thread_tuner import tune_threads
from .twins import EXIT_ID_CLASH, Twins
from .weights import Weights

__all__ = ["EXIT_ID_CLASH", "ApiAddress", "Node"]

#: How often the draft model of each local stage 0 is chosen again.
DRAFT_CHECK_S = 1.0

log = logging.getLogger("meshd.node")


@dataclass(frozen=True)
class ApiAddress:
    """Where this node's API listens (bound before the node starts: it goes in the card)."""

    host: str
    port: int


class Node:
    """One meshd process. Build it with :meth:`start`; every part is there from then on."""

    def __init__(
        self,
        *,
        config: NodeConfig,
        identity: Identity,
        state: ClusterState,
        gossip: Gossip,
        dataplane: DataPlane,
        presence: Presence,
        peers: Peers,
        membership: Membership,
        twins: Twins,
        supervisor: Supervisor,
        instances: Instances,
        requests: Requests,
        metrics: Metrics,
        counters: DropCounters,
        tasks: Tasks,
        access: Access,
        ctx: zmq.asyncio.Context,
        join_port: int,
        weights: Weights,
    ) -> None:
        self.config = config
        self.weights = weights
        self.identity = identity
        self.state = state
        self.gossip = gossip
        self.dataplane = dataplane
        self.presence = presence
        self.peers = peers
        self.membership = membership
        self.twins = twins
        self.supervisor = supervisor
        self.sleep = Sleep(identity.node_id, state, config.keep_alive)
        self.instances = instances
        self.requests = requests
        self.metrics = metrics
        self.counters = counters
        self.tasks = tasks
        self.services = NodeServices(
            config=config,
            state=state,
            presence=presence,
            gossip=gossip,
            dataplane=dataplane,
            instances=instances,
            requests=requests,
            supervisor=supervisor,
            metrics=metrics,
            counters=counters,
            access=access,
            twins=twins,
            discovery=lambda: self._discovery,
        )
        self.access = access
        self.ctx = ctx
        #: Where nodes that are not members ask to join (0: an open cluster).
        self.join_port = join_port
        self._discovery: Any = None
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()

    @property
    def node_id(self) -> str:
        """This node's id."""
        return self.identity.node_id

    @property
    def exit_code(self) -> int:
        """The process's exit code: :data:`EXIT_ID_CLASH` if it gave its id way."""
        return EXIT_ID_CLASH if self.twins.gave_way else 0

    # -- building ------------------------------------------------------------------
    @classmethod
    async def start(cls, config: NodeConfig, bind_api: Callable[[], ApiAddress]) -> Node:
        """Find this node's cluster (waiting for approval if it is new), bind its API
        (``bind_api``: its address goes in the card), build every part, publish the
        card and start the loops."""
        identity = load_identity(config.data_dir)
        try:
            ctx = zmq.asyncio.Context.instance()
            cluster = await enroll(config, identity, ctx)
            node = await _assemble(config, identity, bind_api(), ctx, cluster)
        except BaseException:
            identity.release()
            raise
        await node._run_parts()
        return node

    def _scan_models(self) -> list[str]:
        return held_models(self.config.model_dirs, [m for m in [self.config.model] if m])

    async def _run_parts(self) -> None:
        cfg = self.config
        self.presence.announce()
        self.gossip.start()
        self.dataplane.start()
        self.weights.start()
        self.tasks.spawn(self.presence.run(), name="heartbeat")
        self.tasks.spawn(self.peers.run(), name="hello")
        self.tasks.spawn(self.membership.run(), name="liveness")
        self.tasks.spawn(self.instances.run_repairs(), name="repair")
        self.tasks.spawn(self._choose_drafts(), name="drafts")
        runners = self.supervisor.runners.values
        self.tasks.spawn(tune_threads(runners), name="threads")
        placed = lambda: instances(self.state.map)  # noqa: E731
        self.tasks.spawn(self.sleep.run(placed, runners, self._reconcile), name="keep-alive")
        if self.access.desk is not None:
            self.tasks.spawn(self.access.desk.run(), name="join-desk")
        if cfg.discovery:
            await self._start_discovery()
        self.tasks.spawn(self.instances.at_start(cfg.model), name="model")
        self.tasks.spawn(self.instances.kept.run(), name="keep-placements")
        facts, every = self.instances.facts, cfg.models_rescan
        self.tasks.spawn(self.presence.watch_models(self._scan_models, facts, every), name="models")
        card = self.presence.card
        log.info(
            "node %s (%s) up: api http://%s:%d, mesh port %d, pub port %d, backends %s",
            cfg.name, self.node_id, card.api_host, card.api_port,
            self.gossip.mesh_port, self.gossip.pub_port,
            ", ".join(card.backends) or "none",
        )  # fmt: skip
        for d in card.devices:
            log.info("GPU %s (%s, %s): %s free of %s%s", d.name, d.description, d.backend,
                     fmt_bytes(d.mem_free), fmt_bytes(d.mem_total),
                     ", shared with the host" if d.unified else "")  # fmt: skip

    async def _choose_drafts(self) -> None:
        """Keep each stage 0 here told which draft model to ask: instances are placed,
        get ready, move and go (see ``meshd.placement.drafts``)."""

        while True:
            view = self.state.view()  # one view a tick, whatever the runners here

            def pick(iid: str, view: ClusterView = view) -> tuple[str, wire.Addr] | None:
                inst = view.instances.get(iid)
                got = view.draft_for(inst) if inst is not None else None
                return (got[0].id, got[1]) if got else None

            tell_drafts(self.supervisor.runners.values(), pick)
            await asyncio.sleep(DRAFT_CHECK_S)

    async def _start_discovery(self) -> None:
        from meshd.transport.discovery import Discovery

        card = self.presence.card
        self._discovery = Discovery(
            node_id=self.node_id,
            name=self.config.name,
            cluster_hash=self.gossip.cluster.hex(),
            mesh_port=self.gossip.mesh_port,
            api_port=card.api_port,
            version=meshd.__version__,
            addresses=card.addresses,
            on_peer=self.peers.on_discovered,
            join_port=self.join_port,
            cluster_name=self.access.cluster.name if self.access.cluster else self.config.cluster,
        )
        try:
            await self._discovery.start()
        except Exception as e:  # no multicast here: static peers still work
            log.warning("Bonjour discovery unavailable (%s); use --peer HOST:PORT", e)
            self._discovery = None

    # -- wiring --------------------------------------------------------------------
    def _on_remote(self, changed: list[Entry]) -> None:
        """Entries merged from the network: members (first: a card is dialled with its
        member's key), liveness, peers, runners, waiters."""
        members = any(e.key.startswith(MEMBER) for e in changed)
        if members:
            self._members_changed()
        moved = self.membership.on_entries(changed) or members
        if any(e.key.startswith(INSTANCE) for e in changed):
            self._reconcile()
            moved = True
        if moved:
            self.state.changes.notify()

    def _on_local(self, e: Entry) -> None:
        """An entry this node wrote."""
        if e.key.startswith(INSTANCE):
            self._reconcile()
            self.state.changes.notify()
        elif e.key.startswith(MEMBER):
            self._members_changed()
            self.state.changes.notify()

    def _members_changed(self) -> None:
        self.access.refresh(self.state.replica)
        self.access.save_soon(self.state.replica, self.tasks)

    def _members_removed(self, gone: set[str]) -> None:
        """Members were removed: end every connection they hold to this node. Sockets
        this node dials to them close; the PUB is bound anew, since a PUB cannot drop
        one subscriber (members resubscribe at once, the removed fail ZAP); what they
        send on a connection opened before is dropped by the receive loops."""
        self.membership.forget_removed(gone)
        for nid in gone:
            self.dataplane.drop_node(nid)
        self.tasks.spawn(self.gossip.reopen_pub(), name="reopen-pub")

    async def _introduce(self, host: str, join_port: int) -> bool:
        """Vouch for this node at a peer's join desk (a node started with the cluster's
        secret), so its sockets admit this node before the first hello; False when the
        peer did not take it."""
        changed = await self.access.introduce(self.ctx, self.state.replica, host, join_port)
        if changed:
            self._on_remote(changed)
        return changed is not None

    def _reconcile(self) -> None:
        self.supervisor.schedule(lambda: self.sleep.awake(instances(self.state.map)))
        self.instances.kept.changed()

    def _give_way(self) -> None:
        # No goodbye and no drain: the id is the other process's now.
        self._hurry.set()
        self.request_stop()

    # -- lifecycle -----------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the node to stop (signal handlers call this). The first request drains
        (stages move to other nodes, owned requests finish); a second one hurries."""
        if self._stopping.is_set():
            self._hurry.set()
        self._stopping.set()

    async def wait(self) -> None:
        """Until a stop is requested."""
        await self._stopping.wait()

    @property
    def hurried(self) -> bool:
        """A second stop request (or giving the id way): no drain."""
        return self._hurry.is_set()

    async def drain(self) -> None:
        """Let the requests in flight here finish, then return: with none, at once.

        The ``draining`` heartbeat goes out first: new API requests get 503 and peers
        re-place (sticky) every instance with a stage here. The drain waits only while
        requests are in flight, this node's own (its API) or passing through its stages
        (another node's): a stream cut by a stage's move is replayed on the new plan,
        so it ends here as soon as the move is ready, or when it finishes. An idle node
        has nothing to drain and stops at once; peers repair what it held when its
        goodbye arrives. Bounded by ``drain_timeout``; a second stop request cuts it.
        """
        timeout = self.config.drain_timeout
        # New API requests get 503 `draining` from now on (and /healthz says so): what
        # this node accepted now it would have to finish before it may exit.
        self.presence.draining = True
        await self.presence.beat()

        def busy() -> tuple[int, int]:
            return self.requests.in_flight(), self.supervisor.active()

        own, through = busy()
        if not own and not through:
            log.info("draining: no request in flight, stopping now")
            return
        log.info(
            "draining: waiting up to %.0f s for %d request(s) of this node and %d through "
            "its stages to finish or move", timeout, own, through,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            while not self._hurry.is_set():
                if busy() == (0, 0):
                    log.info("draining: every request ended, stopping now")
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # Runners report their load in heartbeats' statuses; requests ending
                # here notify changes too. Poll as well: a runner's count may change
                # without any shared-state change to wake us.
                changed = asyncio.ensure_future(self.state.changes.wait(min(left, 0.5)))
                await asyncio.wait({changed, hurry}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
        finally:
            hurry.cancel()
        if self._hurry.is_set():
            log.warning("drain cut short by a second stop request")
        else:
            own, through = busy()
            log.warning(
                "drain ended after %.0f s with %d request(s) of this node and %d through its "
                "stages still open", timeout, own, through,
            )  # fmt: skip
        await self.end_open_requests("drain ended with the request open")

    async def end_open_requests(self, why: str) -> None:
        """End every request this node's API still has open with a typed error
        (``node_stopping``) and give those events a moment to leave: the API server's
        stop grace would otherwise cut them without a word."""
        if self.requests.in_flight() == 0:
            return
        self.requests.abort(f"the node is stopping ({why})")
        for _ in range(10):
            if self.requests.in_flight() == 0:
                break
            await asyncio.sleep(0.1)

    async def leave(self) -> None:
        """Stop the loops, tell peers this node left, stop Bonjour, end open requests.
        (Then the API server stops, then :meth:`close`.)"""
        await self.tasks.close()
        if not self.twins.gave_way:
            # No goodbye from a process that gave its id way: "stopped" under the shared
            # id would make peers mark the process that keeps it as left.
            with contextlib.suppress(Exception):
                await self.presence.beat("stopped")
                # Let the goodbye leave before the PUB socket closes.
                await asyncio.sleep(0.1)
        if self._discovery is not None:
            with contextlib.suppress(Exception):
                await self._discovery.stop()
        # A second signal skips the drain: what is open still ends typed.
        await self.end_open_requests("stopped without a drain")

    async def close(self) -> None:
        """Stop the runners, close every socket, release the data dir."""
        await self.supervisor.stop_all()
        await self.weights.stop()
        await self.dataplane.stop()
        await self.gossip.stop()
        self.access.close()
        self.identity.release()


async def _assemble(
    cfg: NodeConfig,
    identity: Identity,
    api: ApiAddress,
    ctx: zmq.asyncio.Context,
    cluster: StoredCluster | None,
) -> Node:
    """Every part of a node, built and wired (nothing runs yet)."""
    node: Node  # bound below; the callbacks run only once the parts have started
    metrics = Metrics()
    counters = DropCounters(lambda sock, reason, n: metrics.dropped.labels(sock, reason).inc(n))
    tasks = Tasks()
    changes = Changes()
    access = Access(ctx, cluster, identity.key, ClusterStore(cfg.data_dir), counters)
    keys = access.keys
    replica = Replica(
        identity.node_id, HLC(max_drift_ms=cfg.max_clock_drift_ms), **access.replica_options()
    )
    access.install(replica, cfg.name)
    backends, devices = await probe(cache_dir=cfg.cache_dir)
    incarnation = secrets.token_hex(6)
    mesh_port = cfg.mesh_port
    if access.secured and mesh_port == 0:
        mesh_port = free_port_pair(cfg.mesh_host)
    gossip = Gossip(
        replica,
        ctx=ctx,
        cluster=wire.cluster_hash(cluster.id if cluster is not None else cfg.cluster),
        incarnation=incarnation,
        own_entries=lambda: node.presence.own_entries(),
        on_change=lambda changed: node._on_remote(changed),
        on_refused=lambda res, source: node.twins.on_refused(res, source),
        on_own_welcome=lambda ep, peer, w: node.twins.on_own_welcome(ep, peer, w),
        counters=counters,
        bind_host=cfg.mesh_host,
        mesh_port=mesh_port,
        digest_interval=cfg.digest_interval,
        request_timeout=cfg.request_timeout,
        keys=keys,
        peer_rate=cfg.peer_rate,
        admits=access.members.admits if access.secured else None,
        sign=identity.key.sign,
    )
    own = cfg.advertise or _advertised(cfg.mesh_host)
    dataplane = DataPlane(
        ctx,
        node_id=identity.node_id,
        own_addresses=own,
        bind_host=cfg.mesh_host,
        counters=counters,
        keys=keys,
        server_key=access.members.key_of,
    )
    state = ClusterState(
        replica,
        Liveness(cfg.suspect_after, cfg.dead_after),
        publish=gossip.publish,
        changes=changes,
        tasks=tasks,
        on_write=lambda e: node._on_local(e),
    )
    join_port = access.open_desk(
        ctx, state, cfg.name, cfg.mesh_host, join_port_of(gossip.mesh_port)
    )
    cache_dir = cfg.cache_dir
    roots = ModelRoots(cfg.model_dirs, allowed=[cfg.model] if cfg.model else [])
    weights = Weights(
        ctx, state, roots, cache_dir=cache_dir, own_addresses=own,
        bind_host=cfg.mesh_host, keys=keys, counters=counters,
        server_key=access.members.key_of,
        admits=access.members.admits if access.secured else None,
    )  # fmt: skip
    supervisor = Supervisor(
        identity.node_id,
        SupervisorSettings.from_config(cfg, memory=cap_memory(sysinfo.mem_total(), cfg.max_memory)),
        resolve_path=lambda m: roots.resolve(m).path,
        on_status=lambda: node.presence.beat_soon(),
        keys=keys,
        fetch=weights.fetch,
        fetchable=weights.can_fetch,
    )
    requests = Requests(state, dataplane, cfg, on_awake=lambda: node.presence.beat_soon())
    instances_ = Instances(state, cfg, cache_dir=cache_dir, aborted=lambda: requests.aborted,
                           roots=roots, wake=requests.wake)  # fmt: skip
    peers = Peers(
        state, gossip, tasks, own_addresses=own,
        virtual=virtual_addresses(),
        seeds=list(cfg.peers),
        hello_interval=cfg.hello_interval,
        introduce=(lambda h, p: node._introduce(h, p)) if cfg.secret else None,
        key_of=access.members.key_of if access.secured else None,
        member_at=(lambda h, p: access.member_at(ctx, h, p)) if access.secured else None,
    )  # fmt: skip
    membership = Membership(
        state, gossip, peers, dead_after=cfg.dead_after, forget_after=cfg.forget_after,
        tombstone_grace_ms=cfg.tombstone_grace_ms,
    )  # fmt: skip
    card = await first_card(
        cfg, identity.node_id, incarnation, backends, devices, own,
        ports=(gossip.mesh_port, gossip.pub_port, api.port, dataplane.port, weights.port),
        api_host=api.host,
    )  # fmt: skip
    presence = Presence(
        state,
        tasks,
        card,
        heartbeat_interval=cfg.heartbeat_interval,
        max_memory=cfg.max_memory,
        synced=lambda: membership.synced(),
        runners=lambda: supervisor.statuses() + node.sleep.statuses(instances(state.map)),
        awake=requests.awake,
        in_flight=dataplane.in_flight,
        speed=metrics.speed.summary,
        decode_bps=lambda: decode_bps(supervisor.runners.values()),
        links=gossip.mesh,
    )
    twins = Twins(
        state, gossip, peers, tasks, card=lambda: node.presence.card,
        identity_file=identity.data_dir / ID_FILE, on_give_way=lambda: node._give_way(),
        public=identity.key.public, curve=keys.public if keys is not None else None,
    )  # fmt: skip
    node = Node(
        config=cfg,
        identity=identity,
        state=state,
        gossip=gossip,
        dataplane=dataplane,
        presence=presence,
        peers=peers,
        membership=membership,
        twins=twins,
        supervisor=supervisor,
        instances=instances_,
        requests=requests,
        metrics=metrics,
        counters=counters,
        tasks=tasks,
        access=access,
        ctx=ctx,
        join_port=join_port,
        weights=weights,
    )
    access.on_members(supervisor.set_members)
    access.on_members(lambda _members: peers.repoint())
    access.on_removed(lambda gone: node._members_removed(gone))
    access.refresh(replica)  # the runners start with the members known now
    return node


def _advertised(bind_host: str) -> list[str]:
    if bind_host not in ("0.0.0.0", "", "::"):
        return [bind_host]
    return local_addresses()

"""The meshd daemon: wires identity, gossip, discovery, liveness and the API on one loop.

It holds no protocol logic of its own: the CRDT rules live in ``meshd.crdt``, the wire
in ``meshd.transport``, HTTP in ``meshd.api``. What is here is the glue: which peers to
point the sockets at, when to beat, when to collect tombstones, how to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

import msgspec
import zmq.asyncio

import meshd
from meshd import models
from meshd.crdt import Liveness, stable_horizon
from meshd.crdt.hlc import HLC, pack
from meshd.crdt.lww import Entry
from meshd.crdt.replica import MergeResult, Replica
from meshd.crdt.views import (
    HEALTH,
    INSTANCE,
    NODE,
    Health,
    ModelFacts,
    NodeCard,
    cards,
    decode,
    health_key,
    healths,
    instances,
    node_key,
)
from meshd.engines.probe import probe
from meshd.transport import wire
from meshd.transport.addresses import choose_address, local_addresses, virtual_addresses
from meshd.transport.dataplane import DataPlane
from meshd.transport.gossip import Endpoint, Gossip
from meshd.transport.security import ClusterKeys, HandshakeReporter, derive_keys, start_zap
from meshd.transport.stats import DropCounters

from . import sysinfo
from .config import NodeConfig
from .identity import Identity, load_identity
from .inference import Inference, auto_instance_id
from .metrics import Metrics
from .supervisor import Supervisor

log = logging.getLogger("meshd.node")

_MAX_HELLO_BACKOFF = 30.0
#: How long a stopping node waits for its stages to move and its requests to finish.
DRAIN_TIMEOUT_S = 30.0
#: Exit code of a node that found another live process running with its node id and
#: gave way (it started later). See docs/operations.md, "The data dir".
EXIT_ID_CLASH = 3
#: Seconds before a card under our id with one same foreign incarnation is checked again.
_TWIN_RECHECK_S = 5.0


class Node:
    """One meshd process."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.counters = DropCounters(
            lambda sock, reason, n: self.metrics.dropped.labels(sock, reason).inc(n)
        )
        self.liveness = Liveness(config.suspect_after, config.dead_after)
        self.incarnation = secrets.token_hex(6)
        self.identity: Identity | None = None
        self.replica: Replica | None = None
        self.gossip: Gossip | None = None
        self.card: NodeCard | None = None
        self.api_port = 0
        self.api_host = ""
        self._zap = None
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()
        self._draining = False
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0
        self._own_addrs: list[str] = []
        #: Address a peer was actually reached at (seed or Bonjour): preferred to guesses.
        self._hints: dict[str, str] = {}
        self._seed_ids: dict[tuple[str, int], str] = {}
        self._next_hello: dict[str, tuple[float, float]] = {}
        self._liveness_seen: dict[str, str] = {}
        self._api = None
        self._discovery = None
        self._refusals_logged: set[tuple[str, str]] = set()
        #: Our addresses on bridges/virtual links: never proof that a peer is on this host.
        self._virtual: set[str] = set()
        #: Peer id -> hosts that, dialled for that peer, answered with our own id.
        self._self_hosts: dict[str, set[str]] = {}
        self._self_logged: set[tuple[str, int]] = set()
        #: Foreign incarnation seen on a card under our id -> when we last checked it.
        self._twin_checks: dict[str, float] = {}
        #: Nodes with a card but no heartbeat yet -> since when (monotonic).
        self._unheard: dict[str, float] = {}
        self._exit_code = 0
        #: True once this process gave its id way to an older process with the same id.
        self._yielded = False
        self.dataplane: DataPlane | None = None
        self.supervisor: Supervisor | None = None
        self.inference: Inference | None = None
        self._reconcile_pending = False
        self._beat_pending = False
        self._last_repair = 0.0
        self._bg: set[asyncio.Task] = set()
        self.started = time.monotonic()

    @property
    def node_id(self) -> str:
        """This node's id."""
        assert self.identity is not None
        return self.identity.node_id

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Bind sockets, publish our card, start loops, discovery and the API."""
        cfg = self.config
        self.identity = load_identity(cfg.data_dir)
        self.replica = Replica(self.identity.node_id, HLC(max_drift_ms=cfg.max_clock_drift_ms))
        backends = await probe()
        ctx = zmq.asyncio.Context.instance()
        keys = self._secure(ctx)
        self.gossip = Gossip(
            self.replica,
            ctx=ctx,
            cluster=wire.cluster_hash(cfg.cluster),
            incarnation=self.incarnation,
            own_entries=self._own_entries,
            on_change=self._on_change,
            on_refused=self._on_refused,
            on_own_welcome=self._on_own_welcome,
            counters=self.counters,
            bind_host=cfg.mesh_host,
            mesh_port=cfg.mesh_port,
            digest_interval=cfg.digest_interval,
            request_timeout=cfg.request_timeout,
            keys=keys,
            peer_rate=cfg.peer_rate,
        )
        self._own_addrs = cfg.advertise or _advertised(cfg.mesh_host)
        self._virtual = virtual_addresses()
        self.dataplane = DataPlane(
            ctx,
            node_id=self.node_id,
            own_addresses=self._own_addrs,
            bind_host=cfg.mesh_host,
            counters=self.counters,
            keys=keys,
        )
        self.cache_dir = cfg.data_dir / "cache"
        self.supervisor = Supervisor(
            self.node_id,
            resolve_path=lambda m: models.resolve_model(m).path,
            cache_dir=self.cache_dir,
            bind_host=cfg.mesh_host,
            on_status=self._runners_changed,
            n_ctx=cfg.n_ctx,
            n_seq_max=cfg.n_seq_max,
            secret=cfg.secret,
        )
        self.inference = Inference(
            node_id=self.node_id,
            state=lambda: self.replica.map,
            write=self._write,
            delete=self._delete,
            is_live=self._is_live,
            is_alive=self._is_alive,
            dataplane=self.dataplane,
            metrics=self.metrics,
            replay_wait=cfg.replay_wait,
        )
        from meshd.api.server import ApiServer

        self._api = ApiServer(self)
        self.api_host = cfg.api_listen_host()
        self.api_port = await self._api.start(self.api_host, cfg.api_port)
        self.card = NodeCard(
            id=self.node_id,
            name=cfg.name,
            incarnation=self.incarnation,
            cluster=cfg.cluster,
            version=meshd.__version__,
            os=sysinfo.os_name(),
            arch=sysinfo.arch(),
            cpu_count=sysinfo.cpu_count(),
            mem_total=self._capped(sysinfo.mem_total()),
            mem_available=self._capped(sysinfo.mem_available()),
            backends=backends,
            addresses=self._own_addrs,
            mesh_port=self.gossip.mesh_port,
            pub_port=self.gossip.pub_port,
            api_port=self.api_port,
            api_host=self.api_host,
            data_port=self.dataplane.port,
            models=await asyncio.to_thread(models.local_models),
            started_ms=int(time.time() * 1000),
        )
        self.replica.write(node_key(self.node_id), self.card)
        self._beat_entry()
        self.gossip.start()
        self.dataplane.start()
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._hello_loop(), name="hello"),
            asyncio.create_task(self._liveness_loop(), name="liveness"),
        ]
        if cfg.discovery:
            await self._start_discovery()
        if cfg.model:
            self._tasks.append(asyncio.create_task(self._ensure_model(cfg.model), name="model"))
        if self.card.models:
            self._tasks.append(asyncio.create_task(self._advertise_held(), name="facts"))
        log.info(
            "node %s (%s) up: api http://%s:%d, mesh port %d, pub port %d, backends %s",
            cfg.name,
            self.node_id,
            self.api_host,
            self.api_port,
            self.gossip.mesh_port,
            self.gossip.pub_port,
            ", ".join(backends) or "none",
        )

    def _secure(self, ctx: zmq.asyncio.Context) -> ClusterKeys | None:
        """Start ZAP and return the cluster keys, or say once that the cluster is open."""
        if self.config.secret is None:
            log.warning(
                "no cluster secret: gossip and activations travel in clear and any machine "
                "on the LAN can join; use --secret-file (see `meshctl secret new`)"
            )
            return None
        keys = derive_keys(self.config.secret)
        reporter = HandshakeReporter(self.counters.add)
        self._zap = start_zap(ctx, keys, lambda: reporter.denied("zap"))
        log.info("cluster secret set: every mesh and data socket uses CURVE")
        return keys

    async def _start_discovery(self) -> None:
        from meshd.transport.discovery import Discovery

        assert self.gossip is not None
        self._discovery = Discovery(
            node_id=self.node_id,
            name=self.config.name,
            cluster_hash=wire.cluster_hash(self.config.cluster).hex(),
            mesh_port=self.gossip.mesh_port,
            api_port=self.api_port,
            version=meshd.__version__,
            addresses=self._own_addrs,
            on_peer=self._on_discovered,
        )
        try:
            await self._discovery.start()
        except Exception as e:  # no multicast here: static peers still work
            log.warning("Bonjour discovery unavailable (%s); use --peer HOST:PORT", e)
            self._discovery = None

    def request_stop(self) -> None:
        """Ask the node to stop (signal handlers call this). The first request drains
        (stages move to other nodes, owned requests finish); a second one hurries."""
        if self._stopping.is_set():
            self._hurry.set()
        self._stopping.set()

    async def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Move this node's stages elsewhere and let the requests it owns finish.

        Peers see the ``draining`` heartbeat and re-place (sticky) every instance with
        a stage here; streams cut by the move are replayed on the new plan. Instances
        the rest of the cluster cannot hold stay until the node exits. Bounded.
        """
        assert self.replica is not None and self.gossip is not None and self.inference
        self._draining = True
        # New API requests get 503 `draining` from now on (and /healthz says so): what
        # this node accepted now it would have to finish before it may exit.
        self.inference.draining = True
        await self.gossip.publish([self._beat_entry()])
        mine = [
            i for i in instances(self.replica.map).values()
            if any(s.node == self.node_id for s in i.stages)
            and self.inference.relocatable(i, without=self.node_id)
        ]  # fmt: skip
        if mine:
            log.info("draining: moving %s to other nodes", ", ".join(i.id for i in mine))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._hurry.is_set():
            insts = instances(self.replica.map)
            pending = [
                i.id for i in mine
                if i.id in insts and (
                    any(s.node == self.node_id for s in insts[i.id].stages)
                    or not self.inference.is_ready(insts[i.id])
                )
            ]  # fmt: skip
            owned = self.dataplane.in_flight() if self.dataplane else 0
            if not pending and owned == 0:
                return
            await asyncio.sleep(0.1)
        if self._hurry.is_set():
            log.warning("drain cut short by a second stop request")
        else:
            log.warning("drain ended after %.0f s with work left", timeout)
        await self._end_open_requests("drain ended with the request open")

    async def _end_open_requests(self, why: str) -> None:
        """End every request this node's API still has open with a typed error
        (``node_stopping``) and give those events a moment to leave: the API server's
        stop grace would otherwise cut them without a word."""
        if self.inference is None or self.dataplane is None or self.dataplane.in_flight() == 0:
            return
        self.inference.abort(f"the node is stopping ({why})")
        for _ in range(10):
            if self.dataplane.in_flight() == 0:
                break
            await asyncio.sleep(0.1)

    async def wait(self) -> None:
        """Until a stop is requested."""
        await self._stopping.wait()

    async def stop(self) -> None:
        """Stop cleanly: tell peers we left, then close everything."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.gossip is not None and self.replica is not None and not self._yielded:
            # No goodbye from a process that gave its id way: "stopped" under the shared
            # id would make peers mark the process that keeps it as left.
            e = self.replica.write(health_key(self.node_id), self._health("stopped"))
            with contextlib.suppress(Exception):
                await self.gossip.publish([e])
                # Let the goodbye leave before the PUB socket closes.
                await asyncio.sleep(0.1)
        if self._discovery is not None:
            with contextlib.suppress(Exception):
                await self._discovery.stop()
        if self._api is not None:
            # A second signal skips the drain: what is open still ends typed.
            await self._end_open_requests("stopped without a drain")
            await self._api.stop()
        if self.supervisor is not None:
            await self.supervisor.stop_all()
        if self.dataplane is not None:
            await self.dataplane.stop()
        if self.gossip is not None:
            await self.gossip.stop()
        if self._zap is not None:
            self._zap.stop()
        if self.identity is not None:
            self.identity.release()

    async def run(self, on_ready: Callable[[Node], None] | None = None) -> int:
        """Start, serve until asked to stop, stop. Returns the process exit code."""
        try:
            await self.start()
            if on_ready is not None:
                on_ready(self)
            await self.wait()
            if not self._hurry.is_set():
                await self.drain()
        finally:
            await self.stop()
        return self._exit_code

    # -- state glue ----------------------------------------------------------------
    def _health(self, state: str = "up") -> Health:
        self._seq += 1
        if state == "up" and self._draining:
            state = "draining"
        return Health(
            seq=self._seq,
            state=state,  # type: ignore[arg-type]
            mem_available=self._capped(sysinfo.mem_available()),
            load=round(sysinfo.load(), 3),
            synced=self._synced(),
            queue_depth=self.dataplane.in_flight() if self.dataplane else 0,
            runners=self.supervisor.statuses() if self.supervisor else [],
        )

    def _capped(self, n: int) -> int:
        cap = self.config.max_memory
        return min(n, cap) if cap > 0 else n

    def _beat_entry(self) -> Entry:
        assert self.replica is not None
        return self.replica.write(health_key(self.node_id), self._health())

    def _own_entries(self) -> list[Entry]:
        assert self.replica is not None
        m = self.replica.map
        return [e for k in (node_key(self.node_id), health_key(self.node_id)) if (e := m.get(k))]

    def _members(self) -> list[str]:
        """Nodes that count for tombstone collection: known, not gone for good (left),
        not forgotten (silent longer than ``forget_after``)."""
        assert self.replica is not None
        now = time.monotonic()
        return [
            n for n in cards(self.replica.map)
            if n == self.node_id
            or (self.liveness.state(n, now) != "left" and not self._forgotten(n, now))
        ]  # fmt: skip

    def _forgotten(self, nid: str, now: float) -> bool:
        """True if ``nid`` has been dead or left (or, with a card, never heard) for
        longer than ``forget_after``. A dead member's frozen ``synced`` would otherwise
        hold the GC horizon back forever, and its card would stay listed forever."""
        cfg = self.config
        st = self.liveness.state(nid, now)
        if st is None:
            # A card that never came with a heartbeat: silent since we first saw it.
            since = self._unheard.setdefault(nid, now)
            return now - since > cfg.dead_after + cfg.forget_after
        self._unheard.pop(nid, None)
        silent = self.liveness.age(nid, now) or 0.0
        if st == "dead":
            return silent > cfg.dead_after + cfg.forget_after  # dead since dead_after
        return st == "left" and silent > cfg.forget_after

    def _forget_silent(self) -> None:
        """Tombstone the card and heartbeat of every forgotten node and stop dialling it.

        Every survivor decides on its own clock and writes its own tombstones; LWW makes
        the concurrent deletes one, and a key already deleted is left alone, so this is
        idempotent. A forgotten node that comes back re-announces itself: its heartbeats
        are newer than the tombstones, and seeing its card deleted it re-stamps it.
        """
        assert self.replica is not None and self.gossip is not None
        now = time.monotonic()
        tombs: list[Entry] = []
        for nid in cards(self.replica.map):
            if nid == self.node_id or not self._forgotten(nid, now):
                continue
            log.info(
                "forgetting node %s: gone for more than %g s",
                self._label(nid), self.config.forget_after,
            )  # fmt: skip
            for key in (node_key(nid), health_key(nid)):
                if key in self.replica.map:
                    tombs.append(self.replica.delete(key))
            self.gossip.drop_peer(nid)
            self._next_hello.pop(nid, None)
            self._unheard.pop(nid, None)
        if tombs:
            self._spawn(self.gossip.publish(tombs))

    def _synced(self) -> int:
        assert self.replica is not None and self.gossip is not None
        peers = [n for n in self._members() if n != self.node_id]
        if not peers:
            return self.replica.clock.now()
        return min(self.gossip.synced_from.get(p, 0) for p in peers)

    def _on_change(self, changed: list[Entry]) -> None:
        now = time.monotonic()
        if any(e.key.startswith(INSTANCE) for e in changed):
            self._schedule_reconcile()
        for e in changed:
            if e.key.startswith(HEALTH) and e.value is not None:
                nid = e.key[len(HEALTH) :]
                h = decode(e.value, Health)
                if h is not None and nid != self.node_id:
                    self.liveness.beat(nid, e.hlc, now, stopped=h.state == "stopped")
            elif e.key.startswith(NODE) and e.value is not None:
                nid = e.key[len(NODE) :]
                card = decode(e.value, NodeCard)
                if card is not None and nid != self.node_id and card.id == nid:
                    self._point_at(nid, card)

    def _point_at(self, nid: str, card: NodeCard) -> None:
        assert self.gossip is not None
        bad = self._self_hosts.get(nid, set())
        host = self._hints.get(nid)
        if host is None or host in bad:
            host = choose_address(
                self._own_addrs, card.addresses, ambiguous=self._virtual, exclude=bad
            )
        if host == "127.0.0.1" and host not in card.addresses:
            # Same machine, but the peer bound one interface only: dial what it advertised.
            host = next((a for a in card.addresses if a in self._own_addrs), host)
        self.gossip.set_peer(nid, Endpoint(host, card.mesh_port, card.pub_port))

    def _on_own_welcome(self, ep: Endpoint, peer: str | None, welcome: wire.Welcome) -> None:
        """A hello at ``ep`` was answered under our own id: ourselves, or a twin."""
        assert self.replica is not None
        theirs = next(
            (e for e in welcome.entries if e.key == node_key(self.node_id) and e.value), None
        )
        card = decode(theirs.value, NodeCard) if theirs and theirs.value else None
        if card is not None and card.incarnation != self.incarnation:
            self._twin_found(card, ep)
            return
        # This process answered itself: the address was one of ours (a bridge address
        # another host shares, or a seed naming this node). Try the peer's other ones.
        where = (ep.host, ep.mesh_port)
        if where not in self._self_logged:
            self._self_logged.add(where)
            log.warning(
                "%s reaches this node itself, not %s; not a peer%s",
                ep.mesh(), self._label(peer) if peer and not peer.startswith("@") else "a peer",
                ", trying its other addresses" if peer else "",
            )  # fmt: skip
        if peer is None or peer.startswith("@"):
            return
        self._self_hosts.setdefault(peer, set()).add(ep.host)
        if self._hints.get(peer) == ep.host:
            del self._hints[peer]
        card = cards(self.replica.map).get(peer)
        if card is not None:
            self._point_at(peer, card)

    def _suspect_twin(self, clashes: list[Entry]) -> None:
        """Check whether a card under our id with another incarnation is a live process.

        Only a card tells where its writer runs, so only a card is checked: we greet the
        address it names. A forged entry (node ids are public) names no process that
        answers under our id, and changes nothing beyond the re-stamp.
        """
        assert self.gossip is not None
        now = time.monotonic()
        for e in clashes:
            if e.key != node_key(self.node_id) or e.value is None:
                continue
            card = decode(e.value, NodeCard)
            if card is None or card.incarnation == self.incarnation or not card.addresses:
                continue
            if now - self._twin_checks.get(card.incarnation, -_TWIN_RECHECK_S) < _TWIN_RECHECK_S:
                continue
            self._twin_checks[card.incarnation] = now
            host = choose_address(self._own_addrs, card.addresses, ambiguous=self._virtual)
            self._spawn(self._check_twin(Endpoint(host, card.mesh_port)))

    async def _check_twin(self, ep: Endpoint) -> None:
        assert self.gossip is not None
        try:
            welcome = await self.gossip.ask_welcome(ep)
        except (zmq.ZMQError, ValueError, OSError) as e:
            # The card came from the network: its address may be anything at all.
            log.debug("cannot greet %s named by a card under our id: %s", ep.mesh(), e)
            return
        if welcome is not None and welcome.sender == self.node_id:
            self._on_own_welcome(ep, None, welcome)

    def _twin_found(self, other: NodeCard, ep: Endpoint) -> None:
        """Another live process runs with our node id (a cloned VM with a copied data
        dir). Fighting would re-stamp both cards forever and flap every peer between two
        machines, so the two do not fight: the one that started later gives way and
        exits with :data:`EXIT_ID_CLASH`; the older one keeps the id (and its re-stamp
        wins once the other is gone)."""
        assert self.card is not None and self.identity is not None
        mine = (self.card.started_ms, self.incarnation)
        theirs = (other.started_ms, other.incarnation)
        where = f"{ep.host}:{ep.mesh_port}"
        if mine > theirs:
            if self._yielded:
                return
            self._yielded = True
            self._exit_code = EXIT_ID_CLASH
            log.error(
                "another live meshd process (%r at %s) uses this node id %s and started "
                "first: this one stops (exit code %d). Give this machine its own id: "
                "delete %s and start again (a cloned VM also needs its own "
                "/etc/machine-id)",
                other.name, where, self.node_id, EXIT_ID_CLASH,
                self.identity.data_dir / "identity.json",
            )  # fmt: skip
            self._hurry.set()
            self.request_stop()
            return
        if ("twin", other.incarnation) not in self._refusals_logged:
            self._refusals_logged.add(("twin", other.incarnation))
            log.error(
                "another live meshd process (%r at %s) uses this node id %s; it started "
                "later and will stop (exit code %d); this one keeps the id",
                other.name, where, self.node_id, EXIT_ID_CLASH,
            )  # fmt: skip
            self._spawn(self._outlast_twin(ep, other.incarnation))

    async def _outlast_twin(self, ep: Endpoint, incarnation: str) -> None:
        """Wait until the twin at ``ep`` is gone, then announce our card again.

        Its last card may be the newest one peers hold: they would keep dialling a dead
        address for our id (and stop hearing us). Nothing else would fix that, since
        the twin's card is older than our last re-stamp and so never clashes here.
        """
        assert self.gossip is not None and self.replica is not None and self.card
        while True:
            await asyncio.sleep(1.0)
            try:
                w = await self.gossip.ask_welcome(ep)
            except (zmq.ZMQError, ValueError, OSError):
                w = None
            if w is None or w.sender != self.node_id:
                break
            held = next((e for e in w.entries if e.key == node_key(self.node_id)), None)
            card = decode(held.value, NodeCard) if held and held.value else None
            if card is None or card.incarnation != incarnation:
                break
        log.info("the other process with this node id is gone; re-announcing this node")
        await self.gossip.publish([self.replica.write(node_key(self.node_id), self.card)])
        # Peers that followed the twin's card dial its dead sockets, not our PUB: greet
        # them, so our card reaches them over their ROUTER.
        greet = [
            self.gossip.hello(p, nid)
            for nid, p in self.gossip.peers().items()
            if not nid.startswith("@") and nid != self.node_id
        ]
        await asyncio.gather(*greet, return_exceptions=True)

    def _on_refused(self, res: MergeResult, source: str) -> None:
        if res.evicted:
            log.info("peers had forgotten this node (%s); re-announcing it", source)
        if res.clashes:
            self._suspect_twin(res.clashes)
        for reason in res.refused:
            key = (source.split()[-1], reason)
            if key not in self._refusals_logged:
                self._refusals_logged.add(key)
                if reason == "own_id":
                    # Echoes of our own writes never land here (Replica.is_echo): this is
                    # newer than anything we wrote. A card is checked for a live twin.
                    log.warning(
                        "refused entries under this node's id (%s) newer than its own, in "
                        "%s: forged, or another process uses this id; re-stamped",
                        self.node_id, source,
                    )  # fmt: skip
                else:
                    log.warning("refused entries (%s) in %s", reason, source)

    def _on_discovered(self, peer) -> None:
        if peer.node_id == self.node_id:
            return
        self._hints.setdefault(peer.node_id, peer.host)
        t = asyncio.get_running_loop().create_task(self._greet(peer.host, peer.port))
        self._tasks.append(t)

    async def _greet(self, host: str, port: int) -> str | None:
        assert self.gossip is not None
        # No re-stamp of our card here: however old it is, a node's own card is exempt
        # from the GC horizon (Replica.merge_remote), and a peer that had forgotten us
        # sends the tombstone that makes us re-stamp it.
        nid = await self.gossip.hello(Endpoint(host, port))
        if nid is not None and nid != self.node_id:
            self._hints[nid] = host
            self._seed_ids[(host, port)] = nid
            card = cards(self.replica.map).get(nid) if self.replica else None
            if card is not None:
                self._point_at(nid, card)
        return nid

    # -- writes, runners, models ---------------------------------------------------
    def _write(self, key: str, value) -> None:
        assert self.replica is not None and self.gossip is not None
        e = self.replica.write(key, value)
        self._spawn(self.gossip.publish([e]))
        if key.startswith(INSTANCE):
            self._schedule_reconcile()

    def _delete(self, key: str) -> None:
        assert self.replica is not None and self.gossip is not None
        e = self.replica.delete(key)
        self._spawn(self.gossip.publish([e]))
        if key.startswith(INSTANCE):
            self._schedule_reconcile()

    def _is_live(self, nid: str) -> bool:
        return nid == self.node_id or self.liveness.is_live(nid, time.monotonic())

    def _is_alive(self, nid: str) -> bool:
        """Alive and not even suspect (stricter than :meth:`_is_live`)."""
        return nid == self.node_id or self.liveness.state(nid, time.monotonic()) == "alive"

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def _schedule_reconcile(self) -> None:
        if self._reconcile_pending or self.supervisor is None:
            return
        self._reconcile_pending = True

        async def run() -> None:
            await asyncio.sleep(0)  # coalesce a burst of changes
            self._reconcile_pending = False
            assert self.supervisor is not None and self.replica is not None
            await self.supervisor.reconcile(instances(self.replica.map))

        self._spawn(run())

    def _runners_changed(self) -> None:
        # A runner's state is news for every API node: beat now, not at the next tick
        # (coalescing a burst of changes into one beat).
        if self._beat_pending or self.gossip is None or self.replica is None:
            return
        self._beat_pending = True

        async def beat() -> None:
            await asyncio.sleep(0.02)
            self._beat_pending = False
            assert self.gossip is not None
            await self.gossip.publish([self._beat_entry()])

        self._spawn(beat())

    async def _ensure_model(self, model: str) -> None:
        """Make sure the cluster has an instance of ``model`` (``meshd up``'s default).

        Waits for the first peers to answer so a node joining a cluster that already
        serves the model does not place it again; the instance id is the same on every
        node, so nodes starting together converge on one instance.
        """
        assert self.inference is not None
        # Read the model's facts while peers answer: the first request needs them too.
        reading = asyncio.ensure_future(self.inference.facts(model, self.cache_dir))
        await asyncio.sleep(self.config.settle_s)
        try:
            facts = await reading
        except Exception as e:
            log.warning("not serving %s: %s", model, e)
            return
        if self.inference.find_instance(model) is not None:
            return
        from meshd.crdt.views import InstanceSpec

        try:
            await self.inference.create_instance(
                InstanceSpec(model=models.canonical_name(model)), facts, auto_instance_id(model)
            )
        except Exception as e:
            log.warning("could not place %s: %s", model, e)

    async def _advertise_held(self) -> None:
        """Put the facts of the models this node holds in its card (read once, cached
        on disk), so that a node without the file can place one of them on the nodes
        that hold it."""
        assert self.card is not None and self.inference is not None
        found: list[ModelFacts] = []
        for m in self.card.models:
            try:
                found.append(await self.inference.facts(m, self.cache_dir))
            except Exception as e:  # a file that is no usable model: nothing to say
                log.debug("no facts for %s: %s", m, e)
        if not found or self.gossip is None or self.replica is None:
            return
        self.card = msgspec.structs.replace(self.card, model_facts=found)
        await self.gossip.publish([self.replica.write(node_key(self.node_id), self.card)])

    def sync_metrics(self) -> None:
        """Copy gauges that live elsewhere into the metrics registry."""
        if self.supervisor is not None:
            by_state: dict[str, int] = {}
            for r in self.supervisor.statuses():
                by_state[r.state] = by_state.get(r.state, 0) + 1
            for st in ("loading", "ready", "failed"):
                self.metrics.runners.labels(st).set(by_state.get(st, 0))

    # -- loops ---------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        assert self.gossip is not None
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            await self.gossip.publish([self._beat_entry()])

    async def _hello_loop(self) -> None:
        """Greet seeds until they answer, and peers that went quiet until they return."""
        assert self.gossip is not None and self.replica is not None
        while True:
            now = time.monotonic()
            jobs = []
            for host, port in self.config.peers:
                nid = self._seed_ids.get((host, port))
                if nid is None or not self.liveness.is_live(nid, now):
                    jobs.append(self._greet(host, port))
            for nid, ep in list(self.gossip.peers().items()):
                if nid.startswith("@") or self.liveness.is_live(nid, now):
                    self._next_hello.pop(nid, None)
                    continue
                due, backoff = self._next_hello.get(nid, (0.0, self.config.hello_interval))
                if now >= due:
                    self._next_hello[nid] = (now + backoff, min(backoff * 2, _MAX_HELLO_BACKOFF))
                    jobs.append(self.gossip.hello(ep, nid))
            if jobs:
                await asyncio.gather(*jobs, return_exceptions=True)
            await asyncio.sleep(self.config.hello_interval)

    async def _liveness_loop(self) -> None:
        assert self.replica is not None
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for nid in self.liveness.nodes():
                st = self.liveness.state(nid, now) or "unknown"
                if self._liveness_seen.get(nid) != st:
                    if nid in self._liveness_seen or st != "alive":
                        log.info("node %s is %s", self._label(nid), st)
                    if st == "alive" and self._liveness_seen.get(nid) in ("dead", "left"):
                        # Back from a partition or a restart: reconcile state now rather
                        # than at the next digest.
                        assert self.gossip is not None
                        self._spawn(self.gossip.pull(nid))
                    self._liveness_seen[nid] = st
            self._forget_silent()
            self._collect_tombstones()
            if self.inference is not None and now - self._last_repair >= 0.5:
                self._last_repair = now
                self.inference.repair()

    def _collect_tombstones(self) -> None:
        assert self.replica is not None
        hs = healths(self.replica.map)
        members = self._members()
        if len(members) < 2:
            # A lone node has agreed nothing with anyone: a horizon it set alone would
            # refuse the older entries of every node it meets later (the seed it could
            # not reach yet), so it keeps its tombstones until it has company.
            return
        # A member's published clock cannot be ahead of ours by more than drift, and
        # taking it past our own now would let one bad heartbeat collect live deletes.
        now = self.replica.clock.now()
        synced = {n: min(hs[n].synced, now) if n in hs else 0
                  for n in members if n != self.node_id}  # fmt: skip
        synced[self.node_id] = self._synced()
        # The grace keeps the horizon behind every member's wall clock, so a peer whose
        # clock runs a little slow never writes below it.
        stable = stable_horizon(synced) - pack(self.config.tombstone_grace_ms, 0)
        dropped = self.replica.map.collect(stable, members)
        if dropped:
            log.debug("collected %d tombstones", dropped)

    def _label(self, nid: str) -> str:
        c = cards(self.replica.map).get(nid) if self.replica else None
        return f"{c.name} ({nid})" if c else nid

    # -- views for the API ---------------------------------------------------------
    def cluster_view(self) -> dict:
        """The cluster as this node sees it (the body of ``GET /v1/cluster``)."""
        import msgspec

        assert self.replica is not None
        now = time.monotonic()
        m = self.replica.map
        hs = healths(m)
        nodes = []
        for nid, card in sorted(cards(m).items(), key=lambda kv: (kv[1].name, kv[0])):
            if nid == self.node_id:
                live, age = "alive", 0.0
            else:
                live = self.liveness.state(nid, now) or "unknown"
                age = self.liveness.age(nid, now)
            h = hs.get(nid)
            nodes.append(
                {
                    "id": nid,
                    "name": card.name,
                    "liveness": live,
                    "heartbeat_age_s": None if age is None else round(age, 3),
                    "card": msgspec.to_builtins(card),
                    "health": None if h is None else msgspec.to_builtins(h),
                }
            )
        return {
            "self": self.node_id,
            "cluster": self.config.cluster,
            "nodes": nodes,
            "instances": [msgspec.to_builtins(i) for i in instances(m).values()],
        }

    def health_view(self) -> dict:
        """The body of ``GET /healthz``: this node's own vitals and drop counters."""
        assert self.replica is not None and self.gossip is not None
        return {
            "status": "ok",
            "node": self.node_id,
            "name": self.config.name,
            "cluster": self.config.cluster,
            "version": meshd.__version__,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "mesh_port": self.gossip.mesh_port,
            "pub_port": self.gossip.pub_port,
            "api_port": self.api_port,
            "entries": len(self.replica.map),
            # The replica's root hash: equal on two nodes iff they hold the same state.
            "digest": f"{self.replica.map.root():016x}",
            "data_port": self.dataplane.port if self.dataplane else 0,
            "requests_in_flight": self.dataplane.in_flight() if self.dataplane else 0,
            "secured": self.config.secret is not None,
            "dropped": self.counters.snapshot(),
        }


def _advertised(bind_host: str) -> list[str]:
    if bind_host not in ("0.0.0.0", "", "::"):
        return [bind_host]
    return local_addresses()

"""Gossip: deltas on PUB/SUB, digests on a period, anti-entropy pulls over ROUTER/DEALER.

Sockets of one node:

* ROUTER bound on the mesh port (fixed, documented): answers ``Hello`` with ``Welcome``
  (the whole state) and ``Pull`` with ``PullReply`` (the buckets that differ).
* PUB bound on an OS-chosen port, advertised in the node card: ``Delta`` at once on
  every local change, ``Digest`` every ``digest_interval``.
* SUB connected to every known peer's PUB, subscribed to the cluster topic only.
* One DEALER per peer for requests (:mod:`.mesh_peers`, which also keeps the SUB's
  subscriptions), one request in flight per peer, each bounded by ``request_timeout``.

In a secured cluster every socket that dials names the CURVE key of the node it means
(:attr:`Endpoint.key`): only that node can answer there. The ROUTER answers only
senders whose key is a member's now (``admits``), and :meth:`Gossip.reopen_pub` ends
every subscription, so a member removed after it connected stops hearing the cluster
(it cannot come back: ZAP refuses its new handshakes).

PUB/SUB drops messages to slow joiners by design; digests plus pulls make that
harmless. Entries learned through a pull or a hello are re-published once, so news also
spreads epidemically when a PUB link is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from meshd.crdt.hlc import ClockDriftError
from meshd.crdt.lww import Entry, bucket_of
from meshd.crdt.replica import MergeResult, Replica

from . import wire
from .identity import welcome_payload
from .mesh_peers import Endpoint, MeshPeers
from .ratelimit import PeerRateLimiter
from .security import CurveKeys, HandshakeReporter, sender_key, watch_handshakes
from .sockets import CONTROL, bind, decode_frame, open_socket
from .stats import DropCounters

log = logging.getLogger("meshd.gossip")

#: Defaults, documented in docs/operations.md.
DIGEST_INTERVAL = 1.0
REQUEST_TIMEOUT = 2.0
HELLO_INTERVAL = 2.0


#: Gossip messages and mesh requests a second one peer may send (twice that in a burst).
#: A healthy peer sends ~3 (two heartbeats, one digest) plus its changes and pulls.
PEER_RATE = 200.0
#: Bytes of entries one welcome or pull reply carries; a larger state comes in pages
#: (so a state of any size syncs, under the frame limit).
PAGE_BYTES = 1 << 20
#: When a node first, then how often, pulls from each peer whatever the digests say
#: (the round trips of those pulls are the links' figures for placement).
ROUND_TRIP_FIRST = 1.0
ROUND_TRIP_INTERVAL = 10.0
#: Pages one pull may take before it stops (the next digest resumes it).
MAX_PAGES = 256


class Gossip:
    """The control-plane transport of one node. Knows entries, not what they mean."""

    def __init__(
        self,
        replica: Replica,
        *,
        ctx: zmq.asyncio.Context,
        cluster: bytes,
        incarnation: str,
        own_entries: Callable[[], list[Entry]],
        on_change: Callable[[list[Entry]], None],
        on_refused: Callable[[MergeResult, str], None] | None = None,
        on_own_welcome: Callable[[Endpoint, str | None, wire.Welcome], None] | None = None,
        counters: DropCounters | None = None,
        bind_host: str = "0.0.0.0",
        mesh_port: int = 0,
        digest_interval: float = DIGEST_INTERVAL,
        request_timeout: float = REQUEST_TIMEOUT,
        keys: CurveKeys | None = None,
        peer_rate: float = PEER_RATE,
        admits: Callable[[bytes], bool] | None = None,
        sign: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self.replica = replica
        self.keys = keys
        #: Whether a sender's CURVE key is a member's now (None: anyone, open cluster).
        self.admits = admits
        #: Signs the challenge of a hello (this node's key): proves a Welcome is fresh.
        self.sign = sign
        self.limiter = PeerRateLimiter(peer_rate, 2 * peer_rate)
        self.ctx = ctx
        self.cluster = cluster
        self.incarnation = incarnation
        self.own_entries = own_entries
        self.on_change = on_change
        self.on_refused = on_refused
        self.on_own_welcome = on_own_welcome
        self.counters = counters or DropCounters()
        self.bind_host = bind_host
        self.digest_interval = digest_interval
        self.request_timeout = request_timeout
        #: Peer id -> clock of the peer such that we hold all it held then.
        self.synced_from: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._bg: set[asyncio.Task[object]] = set()

        self.router = open_socket(ctx, zmq.ROUTER, CONTROL, keys, server=True)
        self.mesh_port = bind(self.router, bind_host, mesh_port)
        self.pub = open_socket(ctx, zmq.PUB, CONTROL, keys, server=True)
        self.pub_port = bind(self.pub, bind_host)
        self._pub_lock = asyncio.Lock()
        self._reporter: HandshakeReporter | None = None
        # The SUB dials every peer, each with its own key, set before each connect
        # (set_peer); until the first, it names this node's own.
        own = keys.public if keys is not None else None
        self.sub = open_socket(ctx, zmq.SUB, CONTROL, keys, server=False, server_key=own)
        self.mesh = MeshPeers(ctx, keys, self.sub, self.counters, request_timeout)
        self.sub.setsockopt(zmq.SUBSCRIBE, cluster)
        self._drop_mesh = lambda reason: self.counters.add("mesh", reason)
        self._drop_gossip = lambda reason: self.counters.add("gossip", reason)

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        """Start the receive loops and the digest timer on the running loop."""
        self._tasks = [
            asyncio.create_task(self._router_loop(), name="gossip-router"),
            asyncio.create_task(self._sub_loop(), name="gossip-sub"),
            asyncio.create_task(self._digest_loop(), name="gossip-digest"),
            asyncio.create_task(self._round_trip_loop(), name="gossip-rtt"),
        ]
        if self.keys is not None:
            # The SUB names every peer it dials, so a peer without the secret is
            # reported by address; the bound sockets count intruders.
            self._reporter = HandshakeReporter(self.counters.add)
            for name, sock in (("mesh", self.router), ("pub", self.pub), ("sub", self.sub)):
                self._watch(name, sock)

    def _watch(self, name: str, sock: zmq.asyncio.Socket) -> None:
        if self._reporter is not None:
            watch = watch_handshakes(sock, name, self._reporter, bound=sock is not self.sub)
            self._tasks.append(asyncio.create_task(watch, name=f"hs-{name}"))

    async def stop(self) -> None:
        """Stop loops and close sockets (after the last publish has had its linger)."""
        for t in [*self._tasks, *self._bg]:
            t.cancel()
        for t in [*self._tasks, *self._bg]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.mesh.close()
        self.sub.close(linger=0)
        self.router.close(linger=0)
        self.pub.close()

    # -- peers ---------------------------------------------------------------------
    def set_peer(self, node_id: str, endpoint: Endpoint) -> None:
        """Point at a peer's sockets (connect, or move if its address changed)."""
        self.mesh.set(node_id, endpoint)

    def drop_peer(self, node_id: str) -> None:
        """Forget a peer's sockets."""
        self.mesh.drop(node_id)
        self.synced_from.pop(node_id, None)

    def rtt_ms(self) -> dict[str, float]:
        """Round trip to each known peer in ms (see :meth:`MeshPeers.rtt_ms`)."""
        return self.mesh.rtt_ms()

    def peers(self) -> dict[str, Endpoint]:
        """Peers this node currently points at."""
        return self.mesh.endpoints()

    async def request(
        self, endpoint: Endpoint, msg: wire.GossipMessage, peer: str | None = None
    ) -> wire.GossipMessage | None:
        """One request to a peer's ROUTER, its reply (None: timeout or undecodable)."""
        return await self.mesh.request(endpoint, msg, peer)

    # -- publishing ----------------------------------------------------------------
    async def publish(self, entries: list[Entry]) -> None:
        """Publish changed entries to every subscriber (fire and forget)."""
        if entries:
            msg = wire.Delta(sender=self.replica.node_id, entries=entries)
            async with self._pub_lock:
                await self.pub.send_multipart([self.cluster, wire.encode(msg)])

    async def reopen_pub(self, tries: int = 50) -> None:
        """Close the PUB and bind a new one on the same port: every subscription ends,
        and only members pass ZAP again (a PUB cannot drop one subscriber). Members'
        SUBs reconnect on their own; what they missed comes with the next digest."""
        # What was just published (the removal itself, often) leaves first: the
        # members would otherwise wait for the next digest to hear of it.
        await asyncio.sleep(0.05)
        async with self._pub_lock:
            self.pub.close(linger=100)
            for i in range(tries):
                pub = open_socket(self.ctx, zmq.PUB, CONTROL, self.keys, server=True)
                try:
                    bind(pub, self.bind_host, self.pub_port)
                except zmq.ZMQError:
                    pub.close(linger=0)
                    if i == tries - 1:
                        raise
                    await asyncio.sleep(0.02)  # libzmq releases the port asynchronously
                    continue
                self.pub = pub
                self._watch("pub", pub)
                return

    async def publish_digest(self) -> None:
        """Publish the per-bucket digest of the whole state."""
        m = self.replica.map
        msg = wire.Digest(
            sender=self.replica.node_id,
            hlc=self.replica.clock.now(),
            buckets=list(m.digest()),
        )
        async with self._pub_lock:
            await self.pub.send_multipart([self.cluster, wire.encode(msg)])

    # -- requests ------------------------------------------------------------------
    async def hello(self, endpoint: Endpoint, peer: str | None = None) -> str | None:
        """Greet a peer at ``endpoint``: give it our entries, take its whole state.

        Returns the peer's node id, or None if it did not answer in time, refused, or
        answered with our own id (then ``on_own_welcome`` decides what that means).
        """
        reply = await self.ask_welcome(endpoint, peer)
        if reply is None:
            return None
        if reply.sender == self.replica.node_id:
            # Our own id answered: the address reaches this very node (a bridge address
            # that two hosts share), or a second process that runs with our id. Not a
            # peer either way: its entries under our id are no news to merge, and taking
            # its clock as "synced" would let tombstone collection trust ourselves.
            if self.on_own_welcome is not None:
                self.on_own_welcome(endpoint, peer, reply)
            return None
        self._merge(reply.entries, f"welcome from {reply.sender}", republish=True)
        if reply.more:
            # A large state: the rest comes by pulls, a page at a time (then synced).
            self._spawn(self._pull_then_clear(reply.sender, reply.hlc))
        else:
            self._synced(reply.sender, reply.hlc, "request")
        return reply.sender

    async def ask_welcome(
        self, endpoint: Endpoint, peer: str | None = None, nonce: bytes = b""
    ) -> wire.Welcome | None:
        """Send a ``Hello`` (our own entries) to ``endpoint``; return its ``Welcome``
        without merging it, or None on no answer or a refusal. With a ``nonce``, the
        answer's ``proof`` signs it (see :func:`~.identity.welcome_payload`)."""
        msg = wire.Hello(
            sender=self.replica.node_id,
            cluster=self.cluster,
            incarnation=self.incarnation,
            entries=self.own_entries(),
            nonce=nonce,
        )
        reply = await self.request(endpoint, msg, peer)
        if isinstance(reply, wire.Refused):
            log.warning("peer at %s refused hello: %s", endpoint.mesh(), reply.message)
            return None
        return reply if isinstance(reply, wire.Welcome) else None

    async def pull(self, peer: str, since: int | None = None) -> bool:
        """Anti-entropy: fetch from ``peer`` every bucket that differs from ours, a page
        at a time. True when it completed; then we hold all ``peer`` held as of its
        clock at the first page (or ``since``, a welcome's, if older)."""
        p = self.mesh.links.get(peer)
        if p is None:
            return False
        after_bucket, after_key = -1, ""
        first: int | None = since
        for _ in range(MAX_PAGES):
            msg = wire.Pull(
                sender=self.replica.node_id, buckets=list(self.replica.map.digest()),
                after_bucket=after_bucket, after_key=after_key,
            )  # fmt: skip
            reply = await self.request(p.endpoint, msg, peer)
            if not isinstance(reply, wire.PullReply):
                return False
            first = reply.hlc if first is None else min(first, reply.hlc)
            self._merge(reply.entries, f"pull from {peer}", republish=True)
            if not reply.more or not reply.entries:
                self._synced(peer, first, "request")
                return True
            last = reply.entries[-1]
            after_bucket, after_key = bucket_of(last.key), last.key
        return False

    # -- receive loops ---------------------------------------------------------------
    async def _router_loop(self) -> None:
        while True:
            raw = await self.router.recv_multipart(copy=False)
            if self.admits is not None and not self.admits(sender_key(raw[-1])):
                # Connected before its removal (ZAP ran then): no answer any more.
                self.counters.add("mesh", "not_member")
                continue
            frames = [f.bytes for f in raw]
            try:
                reply = self._answer(frames)
            except Exception:  # a bad request must never take the node down
                log.exception("error answering a mesh request")
                self.counters.add("mesh", "error")
                continue
            if reply is not None:
                await self.router.send_multipart([frames[0], wire.encode(reply)])

    def _answer(self, frames: list[bytes]) -> wire.GossipMessage | None:
        if len(frames) < 2:
            self.counters.add("mesh", "shape")
            return None
        msg = decode_frame(frames[1], self._drop_mesh, wire.decode_gossip)
        if msg is None:
            return None
        if not self.limiter.allow(getattr(msg, "sender", "")):
            self.counters.add("mesh", "rate_limited")
            return wire.Refused(code="rate_limited", message="too many requests; slow down")
        m = self.replica.map
        if isinstance(msg, wire.Hello):
            if msg.cluster != self.cluster:
                self.counters.add("mesh", "wrong_cluster")
                return wire.Refused(code="wrong_cluster", message="not a node of this cluster")
            self._merge(msg.entries, f"hello from {msg.sender}", republish=True)
            own = self.own_entries()
            rest, cursor = m.diff_page(None, budget=PAGE_BYTES)
            proof = b""
            if msg.nonce and self.sign is not None:
                payload = welcome_payload(msg.nonce[:64], self.replica.node_id, self.incarnation)
                proof = self.sign(payload)
            return wire.Welcome(
                sender=self.replica.node_id,
                hlc=self.replica.clock.now(),
                entries=own + [e for e in rest if e not in own],
                more=cursor is not None,
                incarnation=self.incarnation,
                proof=proof,
            )
        if isinstance(msg, wire.Pull):
            after = None if msg.after_bucket < 0 else (msg.after_bucket, msg.after_key)
            try:
                entries, cursor = m.diff_page(msg.buckets, after, PAGE_BYTES)
            except ValueError as e:
                self.counters.add("mesh", "malformed")
                return wire.Refused(code="bad_digest", message=str(e))
            return wire.PullReply(
                sender=self.replica.node_id,
                hlc=self.replica.clock.now(),
                entries=entries,
                more=cursor is not None,
            )
        self.counters.add("mesh", "unexpected")
        return wire.Refused(code="unexpected", message=f"{type(msg).__name__} is not a request")

    async def _sub_loop(self) -> None:
        while True:
            frames = await self.sub.recv_multipart(copy=True)
            try:
                self._on_gossip(frames)
            except Exception:
                log.exception("error handling gossip")
                self.counters.add("gossip", "error")

    def _on_gossip(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or frames[0] != self.cluster:
            self.counters.add("gossip", "shape")
            return
        msg = decode_frame(frames[1], self._drop_gossip, wire.decode_gossip)
        if msg is None:
            return
        if not self.limiter.allow(getattr(msg, "sender", "")):
            self.counters.add("gossip", "rate_limited")
            return
        if isinstance(msg, wire.Delta):
            self._merge(msg.entries, f"delta from {msg.sender}", republish=False)
        elif isinstance(msg, wire.Digest):
            self._on_digest(msg)
        else:
            self.counters.add("gossip", "unexpected")

    def _on_digest(self, msg: wire.Digest) -> None:
        if msg.sender == self.replica.node_id:
            return
        if tuple(msg.buckets) == self.replica.map.digest():
            self._synced(msg.sender, msg.hlc, "gossip")
            return
        p = self.mesh.links.get(msg.sender)
        if p is None or p.pulling:
            return
        p.pulling = True
        self._spawn(self._pull_then_clear(msg.sender))

    async def _pull_then_clear(self, peer: str, since: int | None = None) -> None:
        try:
            await self.pull(peer, since)
        finally:
            p = self.mesh.links.get(peer)
            if p is not None:
                p.pulling = False

    async def _digest_loop(self) -> None:
        while True:
            await asyncio.sleep(self.digest_interval)
            try:
                await self.publish_digest()
            except zmq.ZMQError:
                log.exception("could not publish digest")

    async def _round_trip_loop(self) -> None:
        """Pull from every peer now and then: anti-entropy that a cluster in sync
        (deltas reach everyone, digests agree) would otherwise never do, and the round
        trips placement reads (:meth:`rtt_ms`). In sync, a pull is one small request."""
        await asyncio.sleep(ROUND_TRIP_FIRST)
        while True:
            links = self.mesh.links
            peers = [n for n, p in links.items() if not n.startswith("@") and not p.pulling]
            for nid in peers:
                self.mesh.links[nid].pulling = True
                self._spawn(self._pull_then_clear(nid))
            await asyncio.sleep(ROUND_TRIP_INTERVAL)

    # -- helpers -------------------------------------------------------------------
    def _synced(self, peer: str, hlc: int, socket: str) -> None:
        """Record that we hold ``peer``'s state as of its clock ``hlc``.

        The clock feeds tombstone collection, so a peer's word is bounded: a clock too
        far ahead is refused, and none is taken past our own (we cannot hold what a
        peer will write later)."""
        try:
            self.replica.clock.check(hlc)
        except ClockDriftError:
            self.counters.add(socket, "clock_drift")
            return
        self.synced_from[peer] = min(hlc, self.replica.clock.now())

    def _merge(self, entries: list[Entry], source: str, republish: bool) -> None:
        res = self.replica.merge_remote(entries)
        if res.reassert:
            self._spawn(self.publish(self.replica.reassert(res.reassert)))
        if res.refused or res.evicted:
            for reason, n in res.refused.items():
                self.counters.add("entries", reason, n)
            if self.on_refused is not None:
                self.on_refused(res, source)
        if res.changed:
            self.on_change(res.changed)
            if republish:
                self._spawn(self.publish(res.changed))

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

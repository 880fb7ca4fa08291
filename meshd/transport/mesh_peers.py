"""The gossip peers one node dials: where each one is (:class:`Endpoint`), its
subscription on the node's one SUB, and one DEALER per peer for mesh requests, and
what those requests measure of each link: its round trip, and its bandwidth (:mod:`.links`).

A link with no bandwidth sample for :data:`PROBE_INTERVAL` is probed: the next pull to
the peer (once its round trip is known) carries :data:`PROBE_BYTES` of padding in a
frame after the message. Every meshd's mesh ROUTER reads the message frame alone, so
an older node answers the pull as any other.

One request in flight per peer, each bounded by ``request_timeout``; a timed-out DEALER
is replaced so a late reply cannot be taken for the answer to the next request. In a
secured cluster every socket that dials names the CURVE key of the node it means
(:attr:`Endpoint.key`): only that node can answer there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from . import wire
from .links import MIN_SAMPLE_BYTES, LinkMeter
from .security import CurveKeys, NoServerKey
from .sockets import CONTROL, decode_frame, open_socket
from .stats import DropCounters

__all__ = ["PROBE_BYTES", "PROBE_INTERVAL", "Endpoint", "MeshPeers", "PeerLink"]

#: Bytes of padding a probe carries, and how often a link is probed at most (a request
#: that carried as many bytes since counts instead): a few hundred KB a peer, rarely.
PROBE_BYTES = 256 * 1024
PROBE_INTERVAL = 300.0


@dataclass(frozen=True)
class Endpoint:
    """Where a peer's sockets are."""

    host: str
    mesh_port: int
    pub_port: int | None = None
    #: The CURVE key (Z85) of the node that must answer there (None: an open cluster).
    key: bytes | None = None

    def mesh(self) -> str:
        """ZeroMQ address of the peer's ROUTER."""
        return f"tcp://{_bracket(self.host)}:{self.mesh_port}"

    def pub(self) -> str | None:
        """ZeroMQ address of the peer's PUB, if known."""
        if self.pub_port is None:
            return None
        return f"tcp://{_bracket(self.host)}:{self.pub_port}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass
class PeerLink:
    """The sockets this node holds for one peer: its SUB subscription, its DEALER."""

    endpoint: Endpoint
    dealer: zmq.asyncio.Socket | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sub_addr: str | None = None
    pulling: bool = False
    #: Round trips (s) of its last mesh requests answered: their least is the link's.
    rtts: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=16))


class MeshPeers:
    """The peers of one node's gossip and the sockets that reach them."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        keys: CurveKeys | None,
        sub: zmq.asyncio.Socket,
        counters: DropCounters,
        request_timeout: float,
    ) -> None:
        self.ctx = ctx
        self.keys = keys
        self.sub = sub
        self.counters = counters
        self.request_timeout = request_timeout
        #: Peer id (or ``@address`` for a one-shot request) -> its sockets.
        self.links: dict[str, PeerLink] = {}
        #: The bandwidth of each peer's link, from the requests that carry many bytes.
        self.meter = LinkMeter()
        #: Seconds between probes of one link (0: never).
        self.probe_interval = PROBE_INTERVAL
        #: Peer id -> when its link was last probed (monotonic).
        self._probed: dict[str, float] = {}
        self._drop: Callable[[str], None] = lambda reason: counters.add("request", reason)

    def set(self, node_id: str, endpoint: Endpoint) -> None:
        """Point at a peer's sockets (connect, or move if its address changed)."""
        p = self.links.get(node_id)
        if p is None:
            p = self.links[node_id] = PeerLink(endpoint)
        elif p.endpoint != endpoint:
            moved = p.endpoint.mesh() != endpoint.mesh() or p.endpoint.key != endpoint.key
            if p.dealer is not None and moved:
                p.dealer.close(linger=0)
                p.dealer = None
            if p.sub_addr is not None and p.endpoint.key != endpoint.key:
                self._unsubscribe(p)
            p.endpoint = endpoint
        pub = endpoint.pub()
        if self.keys is not None and endpoint.key is None:
            pub = None  # no key to dial it with: no member here
        if pub != p.sub_addr:
            self._unsubscribe(p)
            if pub is not None:
                if self.keys is not None:
                    # One SUB dials every peer: libzmq takes the server key at connect.
                    self.sub.curve_serverkey = endpoint.key
                self.sub.connect(pub)
            p.sub_addr = pub

    def _unsubscribe(self, p: PeerLink) -> None:
        if p.sub_addr is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sub.disconnect(p.sub_addr)
            p.sub_addr = None

    def drop(self, node_id: str) -> None:
        """Forget a peer's sockets."""
        p = self.links.pop(node_id, None)
        self.meter.forget(node_id)
        self._probed.pop(node_id, None)
        if p is None:
            return
        self._unsubscribe(p)
        if p.dealer is not None:
            p.dealer.close(linger=0)

    def rtt_ms(self) -> dict[str, float]:
        """Round trip to each known peer in ms: the least of its recent mesh requests
        (a reply's own work only adds to one; the least is closest to the link's)."""
        return {
            nid: round(1000 * min(p.rtts), 2)
            for nid, p in sorted(self.links.items())
            if p.rtts and not nid.startswith("@")
        }

    def endpoints(self) -> dict[str, Endpoint]:
        """Peers this node currently points at."""
        return {k: p.endpoint for k, p in self.links.items()}

    async def request(
        self, endpoint: Endpoint, msg: wire.GossipMessage, peer: str | None = None
    ) -> wire.GossipMessage | None:
        """Send one request to a peer's ROUTER and await its reply (bounded).

        Returns the decoded reply, or None on timeout or an undecodable reply.
        """
        key = peer or f"@{endpoint.mesh()}"
        p = self.links.get(key)
        if p is None:
            p = self.links[key] = PeerLink(endpoint)
            p.sub_addr = None
        async with p.lock:
            if p.dealer is None:
                try:
                    dealer = open_socket(
                        self.ctx, zmq.DEALER, CONTROL, self.keys, server=False,
                        server_key=p.endpoint.key,
                    )  # fmt: skip
                except NoServerKey:
                    # No member's key to dial it with: nothing is sent to it at all.
                    if key.startswith("@"):
                        self.links.pop(key, None)
                    self.counters.add("request", "no_key")
                    return None
                try:
                    dealer.connect(p.endpoint.mesh())
                except zmq.ZMQError:
                    # An address from the network (a card, a seed) that ZeroMQ cannot
                    # even parse: no answer, and no socket or peer slot left behind.
                    dealer.close(linger=0)
                    if key.startswith("@"):
                        self.links.pop(key, None)
                    self.counters.add("request", "bad_address")
                    return None
                p.dealer = dealer
            out = [wire.encode(msg), *self._padding(key, p, msg)]
            await p.dealer.send_multipart(out)
            t0 = time.monotonic()
            try:
                frames = await asyncio.wait_for(
                    p.dealer.recv_multipart(copy=True), self.request_timeout
                )
            except TimeoutError:
                p.dealer.close(linger=0)
                p.dealer = None
                return None
            nbytes = sum(map(len, out)) + sum(map(len, frames))
            self._timed(key, p, nbytes, time.monotonic() - t0)
        if key.startswith("@"):
            # Anonymous (seed) sockets are one-shot.
            self.drop_anonymous(key)
        if len(frames) != 1:
            self.counters.add("request", "shape")
            return None
        return decode_frame(frames[0], self._drop, wire.decode_gossip)

    def probe_due(self, peer: str) -> bool:
        """Whether the link to ``peer`` has gone :attr:`probe_interval` without a
        bandwidth sample or a probe."""
        if self.probe_interval <= 0:
            return False
        last = max(self._probed.get(peer, -math.inf), self.meter.last(peer) or -math.inf)
        return time.monotonic() - last >= self.probe_interval

    def _padding(self, key: str, p: PeerLink, msg: wire.GossipMessage) -> list[bytes]:
        """The probe's padding frame for a pull to ``key`` when its link is due one,
        once its round trip is known (the probe's time is read against it)."""
        if not isinstance(msg, wire.Pull) or key.startswith("@") or not p.rtts:
            return []
        if not self.probe_due(key):
            return []
        self._probed[key] = time.monotonic()
        return [bytes(PROBE_BYTES)]

    def _timed(self, key: str, p: PeerLink, nbytes: int, elapsed: float) -> None:
        """A request's time: a round trip when it moved few bytes, else a bandwidth
        sample (its wire time would spoil the round trip's least)."""
        if nbytes < MIN_SAMPLE_BYTES:
            p.rtts.append(elapsed)
        elif not key.startswith("@"):
            rtt = min(p.rtts) if p.rtts else None
            self.meter.sample(key, nbytes, elapsed, rtt, time.monotonic())

    def bw_mbps(self) -> dict[str, float]:
        """Bandwidth of the link to each known peer in Mbit/s (see :mod:`.links`)."""
        return {k: v for k, v in self.meter.mbps().items() if k in self.links}

    def drop_anonymous(self, key: str) -> None:
        """Close a one-shot (seed) request socket."""
        p = self.links.pop(key, None)
        if p is not None and p.dealer is not None:
            p.dealer.close(linger=0)

    def close(self) -> None:
        """Close every DEALER (the SUB is the gossip's)."""
        for p in self.links.values():
            if p.dealer is not None:
                p.dealer.close(linger=0)

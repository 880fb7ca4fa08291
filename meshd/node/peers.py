"""Where each peer is, and greeting it: seeds, Bonjour finds and cards in one path.

Every way of learning of a peer ends in :meth:`Peers.point_at` (the gossip SUB and a
DEALER aimed at the peer's sockets) or :meth:`Peers.greet` (a ``Hello`` to an address,
answered with the peer's whole state). The address dialled for a peer is the one it was
actually reached at when there is one (a seed, a Bonjour answer), else the best of its
card's addresses from here (:func:`~meshd.transport.addresses.choose_address`). An
address that answers with this node's own id (a bridge address two hosts share, a seed
naming this machine) is never dialled for that peer again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from meshd.crdt.liveness import Liveness
from meshd.crdt.views import NodeCard, cards
from meshd.transport.addresses import choose_address
from meshd.transport.gossip import Endpoint, Gossip

from .state import ClusterState
from .tasks import Tasks

if TYPE_CHECKING:  # zeroconf is imported only when discovery runs
    from meshd.transport.discovery import PeerAddr

__all__ = ["MAX_HELLO_BACKOFF", "Peers"]

log = logging.getLogger("meshd.node")

#: A peer that went quiet is greeted again with exponential backoff up to this.
MAX_HELLO_BACKOFF = 30.0


class Peers:
    """Addresses of peers and the hellos that find them."""

    def __init__(
        self,
        state: ClusterState,
        gossip: Gossip,
        tasks: Tasks,
        *,
        own_addresses: list[str],
        virtual: set[str],
        seeds: list[tuple[str, int]],
        hello_interval: float,
        introduce: Callable[[str, int], Awaitable[bool]] | None = None,
        key_of: Callable[[str], bytes | None] | None = None,
        member_at: Callable[[str, int], Awaitable[tuple[str, bytes] | None]] | None = None,
    ) -> None:
        self.state = state
        self.gossip = gossip
        self.tasks = tasks
        self.own_addresses = own_addresses
        #: Our addresses on bridges/virtual links: never proof that a peer is on this host.
        self.virtual = virtual
        self.seeds = seeds
        self.hello_interval = hello_interval
        #: Vouches for this node at a peer's join desk before the first hello (a node
        #: holding the cluster's secret); None: nothing to do.
        self.introduce = introduce
        #: A member's CURVE key by id, and which member answers at a join port (None:
        #: an open cluster, whose sockets name no key).
        self.key_of = key_of
        self.member_at = member_at
        self._introduced: set[tuple[str, int]] = set()
        #: Address a peer was actually reached at (seed or Bonjour): preferred to guesses.
        self._hints: dict[str, str] = {}
        self._seed_ids: dict[tuple[str, int], str] = {}
        self._next_hello: dict[str, tuple[float, float]] = {}
        #: Peer id -> hosts that, dialled for that peer, answered with our own id.
        self._self_hosts: dict[str, set[str]] = {}
        self._self_logged: set[tuple[str, int]] = set()

    @property
    def liveness(self) -> Liveness:
        return self.state.liveness

    def label(self, nid: str) -> str:
        """``name (id)`` for logs."""
        c = cards(self.state.map).get(nid)
        return f"{c.name} ({nid})" if c else nid

    # -- finding peers -------------------------------------------------------------
    def on_discovered(self, peer: PeerAddr) -> None:
        """A peer answered on Bonjour: greet it at the address it was found at."""
        if peer.node_id == self.state.node_id:
            return
        self._hints.setdefault(peer.node_id, peer.host)
        self.tasks.spawn(self.greet(peer.host, peer.port, join_port=peer.join, nid=peer.node_id))

    async def greet(
        self, host: str, port: int, join_port: int | None = None, nid: str | None = None
    ) -> str | None:
        """Send a ``Hello`` to ``host:port``; the id of the peer that answered, if any.
        (Introduced first at its join desk, ``join_port``, by default the mesh port + 1,
        when this node vouches for itself.) In a secured cluster the hello names the
        key of the member there: ``nid``'s, else the one its join desk names."""
        join_port = join_port or port + 1
        if self.introduce is not None and (host, port) not in self._introduced:
            if not await self.introduce(host, join_port):
                return None  # not up yet, or another cluster: greeted again later
            self._introduced.add((host, port))
        key = None
        if self.key_of is not None and self.member_at is not None:
            key = self.key_of(nid) if nid is not None else None
            if key is None:
                found = await self.member_at(host, join_port)
                if found is None:
                    return None  # no member answers there (yet)
                # Our own id there: this node, or a twin; the hello tells them apart.
                key = found[1]
        # No re-stamp of our card here: however old it is, a node's own card is exempt
        # from the GC horizon (Replica.merge_remote), and a peer that had forgotten us
        # sends the tombstone that makes us re-stamp it.
        nid = await self.gossip.hello(Endpoint(host, port, key=key))
        if nid is not None and nid != self.state.node_id:
            self._hints[nid] = host
            self._seed_ids[(host, port)] = nid
            card = cards(self.state.map).get(nid)
            if card is not None:
                self.point_at(nid, card)
        return nid

    async def run(self) -> None:
        """Greet seeds until they answer, and peers that went quiet until they return."""
        while True:
            now = time.monotonic()
            jobs = []
            for host, port in self.seeds:
                nid = self._seed_ids.get((host, port))
                if nid is None or not self.liveness.is_live(nid, now):
                    jobs.append(self.greet(host, port))
            for nid, ep in list(self.gossip.peers().items()):
                if nid.startswith("@") or self.liveness.is_live(nid, now):
                    self._next_hello.pop(nid, None)
                    continue
                due, backoff = self._next_hello.get(nid, (0.0, self.hello_interval))
                if now >= due:
                    self._next_hello[nid] = (now + backoff, min(backoff * 2, MAX_HELLO_BACKOFF))
                    jobs.append(self.gossip.hello(ep, nid))
            if jobs:
                await asyncio.gather(*jobs, return_exceptions=True)
            await asyncio.sleep(self.hello_interval)

    def forget(self, nid: str) -> None:
        """Stop dialling a forgotten peer."""
        self.gossip.drop_peer(nid)
        self._next_hello.pop(nid, None)

    # -- addresses -----------------------------------------------------------------
    def point_at(self, nid: str, card: NodeCard) -> None:
        """Aim the gossip sockets at ``nid``'s card (the best address from here)."""
        bad = self._self_hosts.get(nid, set())
        host = self._hints.get(nid)
        if host is None or host in bad:
            host = choose_address(
                self.own_addresses, card.addresses, ambiguous=self.virtual, exclude=bad
            )
        if host == "127.0.0.1" and host not in card.addresses:
            # Same machine, but the peer bound one interface only: dial what it advertised.
            host = next((a for a in card.addresses if a in self.own_addresses), host)
        key = self.key_of(nid) if self.key_of is not None else None
        self.gossip.set_peer(nid, Endpoint(host, card.mesh_port, card.pub_port, key))

    def repoint(self) -> None:
        """The members changed: aim at every card again (a member's key may have come
        after its card, or gone with its removal)."""
        for nid, card in cards(self.state.map).items():
            if nid != self.state.node_id and nid in self.gossip.peers():
                self.point_at(nid, card)

    def reached_self(self, ep: Endpoint, peer: str | None) -> None:
        """A hello at ``ep``, meant for ``peer``, was answered by this very process: the
        address is one of ours (a bridge address another host shares, or a seed naming
        this node). Try the peer's other addresses."""
        where = (ep.host, ep.mesh_port)
        if where not in self._self_logged:
            self._self_logged.add(where)
            log.warning(
                "%s reaches this node itself, not %s; not a peer%s",
                ep.mesh(), self.label(peer) if peer and not peer.startswith("@") else "a peer",
                ", trying its other addresses" if peer else "",
            )  # fmt: skip
        if peer is None or peer.startswith("@"):
            return
        self._self_hosts.setdefault(peer, set()).add(ep.host)
        if self._hints.get(peer) == ep.host:
            del self._hints[peer]
        card = cards(self.state.map).get(peer)
        if card is not None:
            self.point_at(peer, card)

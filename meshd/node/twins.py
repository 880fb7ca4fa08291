"""Duplicate node ids: two live processes under one id (a cloned VM with a copied data
dir) are found and settled without a fight.

An entry under our id that is newer than anything this process wrote is refused and
out-stamped (the replica does that); if it is a card with another incarnation, the
address it names is challenged: a ``Hello`` with a fresh nonce, over a socket that names
this node's own CURVE key (only a holder of the key completes that handshake), whose
``Welcome`` must sign the nonce with this node's key under another incarnation. Only
that proves a live twin: node ids are public, and a card or a signature captured
earlier proves nothing about now, so nothing else from the network stops a node (a
suspicion is logged and shown by ``meshctl doctor``). Then the process that started
later gives way (it stops with :data:`EXIT_ID_CLASH`) and the older one keeps the id,
stamping its card again once the twin stops answering.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

from meshd.crdt.lww import Entry
from meshd.crdt.replica import MergeResult
from meshd.crdt.views import NodeCard, decode, node_key
from meshd.transport import wire
from meshd.transport.addresses import choose_address
from meshd.transport.gossip import Endpoint, Gossip
from meshd.transport.identity import verify, welcome_payload

from .peers import Peers
from .state import ClusterState
from .tasks import Tasks

__all__ = ["EXIT_ID_CLASH", "TwinSighting", "Twins"]

log = logging.getLogger("meshd.node")

#: Exit code of a node that found another live process running with its node id and
#: gave way (it started later). See docs/operations.md, "The data dir".
EXIT_ID_CLASH = 3
#: Seconds before a card under our id with one same foreign incarnation is checked again.
TWIN_RECHECK_S = 5.0
#: Other processes under our id remembered for ``meshctl doctor``.
MAX_TWINS_KEPT = 8


@dataclass
class TwinSighting:
    """Another process that wrote under this node's id, as last seen."""

    name: str
    address: str
    at: float
    #: It answered a hello under our id: a live process, not only a card.
    confirmed: bool = False


class Twins:
    """Finds another live process with this node's id and decides who keeps it."""

    def __init__(
        self,
        state: ClusterState,
        gossip: Gossip,
        peers: Peers,
        tasks: Tasks,
        *,
        card: Callable[[], NodeCard],
        identity_file: Path,
        on_give_way: Callable[[], None],
        public: bytes,
        curve: bytes | None = None,
    ) -> None:
        self.state = state
        self.gossip = gossip
        self.peers = peers
        self.tasks = tasks
        self._card = card
        self._identity_file = identity_file
        self._on_give_way = on_give_way
        #: This node's Ed25519 key (a twin's proof is signed with it) and its CURVE key
        #: (None in an open cluster), the key a challenge's socket names.
        self._public = public
        self._curve = curve
        #: True once this process gave its id way to an older process with the same id.
        self.gave_way = False
        #: Foreign incarnation seen on a card under our id -> when we last checked it.
        self._checks: dict[str, float] = {}
        self._logged: set[tuple[str, str]] = set()
        #: Foreign incarnation -> what was seen of it (``meshctl doctor``), bounded.
        self.seen: dict[str, TwinSighting] = {}

    def _saw(self, card: NodeCard, where: str, confirmed: bool) -> None:
        old = self.seen.pop(card.incarnation, None)
        confirmed = confirmed or (old is not None and old.confirmed)
        self.seen[card.incarnation] = TwinSighting(card.name, where, time.monotonic(), confirmed)
        while len(self.seen) > MAX_TWINS_KEPT:
            del self.seen[next(iter(self.seen))]

    @property
    def node_id(self) -> str:
        return self.state.node_id

    def on_refused(self, res: MergeResult, source: str) -> None:
        """Entries the replica refused: log each reason once per source, and check a
        card under our id for a live twin."""
        if res.evicted:
            log.info("peers had forgotten this node (%s); re-announcing it", source)
        if res.clashes:
            self.suspect(res.clashes)
        for reason in res.refused:
            key = (source.split()[-1], reason)
            if key in self._logged:
                continue
            self._logged.add(key)
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

    def on_own_welcome(self, ep: Endpoint, peer: str | None, welcome: wire.Welcome) -> None:
        """A hello at ``ep`` was answered under our own id: ourselves, or a claim to be
        another process with our id, to be challenged (never believed as it stands)."""
        if welcome.incarnation in ("", self._card().incarnation):
            self.peers.reached_self(ep, peer)
            return
        theirs = next(
            (e for e in welcome.entries if e.key == node_key(self.node_id) and e.value), None
        )
        card = decode(theirs.value, NodeCard) if theirs and theirs.value else None
        if card is not None:
            self._saw(card, f"{ep.host}:{ep.mesh_port}", confirmed=False)
        self._challenge(ep)

    def suspect(self, clashes: list[Entry]) -> None:
        """Check whether a card under our id with another incarnation is a live process.

        Only a card tells where its writer runs, so only a card is checked: we greet the
        address it names. A forged entry (node ids are public) names no process that
        answers under our id, and changes nothing beyond the re-stamp.
        """
        now = time.monotonic()
        mine = self._card().incarnation
        for e in clashes:
            if e.key != node_key(self.node_id) or e.value is None:
                continue
            card = decode(e.value, NodeCard)
            if card is None or card.incarnation == mine or not card.addresses:
                continue
            if now - self._checks.get(card.incarnation, -TWIN_RECHECK_S) < TWIN_RECHECK_S:
                continue
            self._checks[card.incarnation] = now
            host = choose_address(
                self.peers.own_addresses, card.addresses, ambiguous=self.peers.virtual
            )
            self._saw(card, f"{host}:{card.mesh_port}", confirmed=False)
            self._challenge(Endpoint(host, card.mesh_port))

    def _challenge(self, ep: Endpoint) -> None:
        now = time.monotonic()
        where = f"{ep.host}:{ep.mesh_port}"
        if now - self._checks.get(where, -TWIN_RECHECK_S) < TWIN_RECHECK_S:
            return
        self._checks[where] = now
        while len(self._checks) > 4 * MAX_TWINS_KEPT:  # addresses come from the network
            del self._checks[next(iter(self._checks))]
        self.tasks.spawn(self._check(Endpoint(ep.host, ep.mesh_port, key=self._curve)))

    async def _check(self, ep: Endpoint) -> None:
        """Challenge ``ep``: a live twin signs a fresh nonce with this node's key."""
        nonce = secrets.token_bytes(32)
        try:
            w = await self.gossip.ask_welcome(ep, f"@twin:{ep.mesh()}", nonce=nonce)
        except (zmq.ZMQError, ValueError, OSError) as e:
            # The card came from the network: its address may be anything at all.
            log.debug("cannot greet %s named by a card under our id: %s", ep.mesh(), e)
            return
        mine = self._card().incarnation
        if w is not None and w.sender == self.node_id and w.incarnation == mine:
            return  # this very process, at an address of its own
        payload = welcome_payload(nonce, self.node_id, w.incarnation if w else "")
        if w is None or w.sender != self.node_id or not verify(self._public, payload, w.proof):
            if ("unproven", ep.mesh()) not in self._logged:
                self._logged.add(("unproven", ep.mesh()))
                log.warning(
                    "%s claimed to be this node (%s) but did not sign a fresh challenge "
                    "with its key: not a twin, ignored (a replay or a forgery)",
                    ep.mesh(), self.node_id,
                )  # fmt: skip
            return
        held = next((e for e in w.entries if e.key == node_key(self.node_id) and e.value), None)
        card = decode(held.value, NodeCard) if held and held.value else None
        if card is not None and card.incarnation == w.incarnation:
            self.found(card, ep)

    def found(self, other: NodeCard, ep: Endpoint) -> None:
        """Another live process runs with our node id. Fighting would re-stamp both
        cards forever and flap every peer between two machines, so the two do not
        fight: the one that started later gives way and exits with
        :data:`EXIT_ID_CLASH`; the older one keeps the id (and its re-stamp wins once
        the other is gone)."""
        card = self._card()
        mine = (card.started_ms, card.incarnation)
        theirs = (other.started_ms, other.incarnation)
        where = f"{ep.host}:{ep.mesh_port}"
        self._saw(other, where, confirmed=True)
        if mine > theirs:
            if self.gave_way:
                return
            self.gave_way = True
            log.error(
                "another live meshd process (%r at %s) uses this node id %s and started "
                "first: this one stops (exit code %d). Give this machine its own id: "
                "delete %s and start again (a cloned VM also needs its own "
                "/etc/machine-id)",
                other.name, where, self.node_id, EXIT_ID_CLASH, self._identity_file,
            )  # fmt: skip
            self._on_give_way()
            return
        if ("twin", other.incarnation) not in self._logged:
            self._logged.add(("twin", other.incarnation))
            log.error(
                "another live meshd process (%r at %s) uses this node id %s; it started "
                "later and will stop (exit code %d); this one keeps the id",
                other.name, where, self.node_id, EXIT_ID_CLASH,
            )  # fmt: skip
            self.tasks.spawn(self._outlast(ep, other.incarnation))

    async def _outlast(self, ep: Endpoint, incarnation: str) -> None:
        """Wait until the twin at ``ep`` is gone, then announce our card again.

        Its last card may be the newest one peers hold: they would keep dialling a dead
        address for our id (and stop hearing us). Nothing else would fix that, since
        the twin's card is older than our last re-stamp and so never clashes here.
        """
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
        self.state.write(node_key(self.node_id), self._card())
        # Peers that followed the twin's card dial its dead sockets, not our PUB: greet
        # them, so our card reaches them over their ROUTER.
        greet = [
            self.gossip.hello(p, nid)
            for nid, p in self.gossip.peers().items()
            if not nid.startswith("@") and nid != self.node_id
        ]
        await asyncio.gather(*greet, return_exceptions=True)

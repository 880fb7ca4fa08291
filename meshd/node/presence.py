"""What this node says about itself: its card (written at start and when it changes)
and its heartbeat (every ``heartbeat_interval``, and at once when a runner changes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

import meshd
from meshd.crdt.lww import Entry
from meshd.crdt.views import (
    NODE,
    Health,
    HealthState,
    ModelSpeed,
    NodeCard,
    RunnerStatus,
    encode,
    health_key,
    node_key,
)
from meshd.domain.facts import ModelFacts
from meshd.domain.keepalive import Awake
from meshd.domain.nodes import Device
from meshd.models.inventory import held_models

from . import sysinfo
from .config import NodeConfig
from .state import ClusterState
from .tasks import Tasks
from .trust import VALUE_CAPS

__all__ = ["BEAT_COALESCE_S", "Presence", "cap_memory"]

log = logging.getLogger("meshd.node")

#: A burst of runner changes within this is one heartbeat, not one each.
BEAT_COALESCE_S = 0.02
#: While models are hashed, the facts read so far are published this often.
FACTS_PUBLISH_S = 2.0
#: Room left in the card under the peers' size cap for what else it carries.
CARD_HEADROOM = 8 << 10


def cap_memory(n: int, max_memory: int) -> int:
    """``n`` bytes, but never more than ``max_memory`` (``--max-memory``; 0: no cap)."""
    return min(n, max_memory) if max_memory > 0 else n


async def first_card(
    cfg: NodeConfig,
    node_id: str,
    incarnation: str,
    backends: list[str],
    devices: list[Device],
    addresses: list[str],
    *,
    ports: tuple[int, int, int, int, int],
    api_host: str,
) -> NodeCard:
    """The card a node starts with: this machine's figures, its sockets' ports, and
    every model on its disk that it may load (its roots), so that any node can place
    one here by name (a scan of names only; the hashing comes later). ``ports``: mesh,
    PUB, API, data plane, weights."""
    mesh_port, pub_port, api_port, data_port, weights_port = ports
    models = await asyncio.to_thread(held_models, cfg.model_dirs, [cfg.model] if cfg.model else [])
    return NodeCard(
        id=node_id, name=cfg.name, incarnation=incarnation, cluster=cfg.cluster,
        version=meshd.__version__, os=sysinfo.os_name(), arch=sysinfo.arch(),
        cpu_count=sysinfo.cpu_count(),
        mem_total=cap_memory(sysinfo.mem_total(), cfg.max_memory),
        mem_available=cap_memory(sysinfo.mem_available(), cfg.max_memory),
        backends=backends, devices=devices, addresses=addresses, api_host=api_host,
        models=models, started_ms=int(time.time() * 1000), mesh_port=mesh_port,
        pub_port=pub_port, api_port=api_port, data_port=data_port, weights_port=weights_port,
    )  # fmt: skip


class Links(Protocol):
    """What this node measured of its links to peers (``transport.mesh_peers.MeshPeers``)."""

    def rtt_ms(self) -> dict[str, float]: ...
    def bw_mbps(self) -> dict[str, float]: ...


class Presence:
    """This node's card and heartbeat in the shared map."""

    def __init__(
        self,
        state: ClusterState,
        tasks: Tasks,
        card: NodeCard,
        *,
        heartbeat_interval: float,
        max_memory: int,
        synced: Callable[[], int],
        runners: Callable[[], list[RunnerStatus]],
        in_flight: Callable[[], int],
        speed: Callable[[], tuple[float, dict[str, ModelSpeed]]] = lambda: (0.0, {}),
        decode_bps: Callable[[], float] = lambda: 0.0,
        links: Links | None = None,
        awake: Callable[[], dict[str, Awake]] = dict,
    ) -> None:
        self.state = state
        self.tasks = tasks
        self.card = card
        self.heartbeat_interval = heartbeat_interval
        self.max_memory = max_memory
        self._synced = synced
        self._runners = runners
        self._in_flight = in_flight
        self._speed = speed
        self._decode_bps = decode_bps
        self._links = links
        self._awake = awake
        #: Set by the drain: the heartbeat says ``draining`` and placement avoids us.
        self.draining = False
        self._seq = 0
        self._beat_pending = False
        self._shape: tuple[str, list[RunnerStatus]] | None = None
        #: Models held whose facts could not be read at the last try.
        self._unread: set[str] = set()

    def health(self, state: HealthState = "up") -> Health:
        """A new heartbeat."""
        self._seq += 1
        if state == "up" and self.draining:
            state = "draining"
        tokens_s, serving = self._speed()
        return Health(
            seq=self._seq,
            state=state,
            mem_available=cap_memory(sysinfo.mem_available(), self.max_memory),
            load=round(sysinfo.load(), 3),
            synced=self._synced(),
            queue_depth=self._in_flight(),
            runners=self._runners(),
            tokens_s=tokens_s,
            serving=serving,
            decode_bps=self._decode_bps(),
            rtt_ms=self._links.rtt_ms() if self._links else {},
            bw_mbps=self._links.bw_mbps() if self._links else {},
            awake=self._awake(),
        )

    def announce(self) -> None:
        """Write the card and a first heartbeat (not yet published: gossip starts after)."""
        self.state.replica.write(node_key(self.card.id), self.card)
        self.state.replica.write(health_key(self.card.id), self.health())

    def own_entries(self) -> list[Entry]:
        """This node's card and heartbeat entries (what a ``Hello`` carries)."""
        m = self.state.map
        keys = (node_key(self.card.id), health_key(self.card.id))
        return [e for k in keys if (e := m.get(k))]

    def update_card(self, **changes: object) -> None:
        """Change fields of the card and publish it."""
        self.card = msgspec.structs.replace(self.card, **changes)
        self.state.write(node_key(self.card.id), self.card)

    async def beat(self, state: HealthState = "up") -> None:
        """Write and publish a heartbeat now (``stopped``: the goodbye)."""
        h = self.health(state)
        await self.state.write_now(health_key(self.card.id), h)
        shape = (h.state, h.runners)
        if shape != self._shape:
            # A runner here changed state (or the node drains): whoever waits on the
            # cluster here must look again, as peers do when they get this beat.
            self._shape = shape
            self.state.changes.notify()

    def beat_soon(self) -> None:
        """A heartbeat within :data:`BEAT_COALESCE_S` (a runner changed: news for every
        API node), one for a burst of changes."""
        if self._beat_pending:
            return
        self._beat_pending = True

        async def beat() -> None:
            await asyncio.sleep(BEAT_COALESCE_S)
            self._beat_pending = False
            await self.beat()

        self.tasks.spawn(beat())

    async def run(self) -> None:
        """Beat every ``heartbeat_interval``."""
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            await self.beat()

    async def watch_models(
        self,
        scan: Callable[[], list[str]],
        read: Callable[[str], Awaitable[ModelFacts]],
        interval: float,
    ) -> None:
        """Advertise the facts of the models held now, then look again every
        ``interval`` (``scan``, in a thread): a model copied in or pulled, or one
        deleted, changes the card's ``models`` and facts.

        A model whose facts could not be read is tried again at every look: a scan
        can catch a file that is still being copied in, which is no model yet."""
        if self.card.models:
            await self.advertise_facts(read)
        while True:
            await asyncio.sleep(interval)
            try:
                names = await asyncio.to_thread(scan)
            except OSError as e:
                log.warning("could not list the models held here: %s", e)
                continue
            if names == self.card.models:
                if self._unread:
                    await self.advertise_facts(read)
                continue
            added = sorted(set(names) - set(self.card.models))
            gone = sorted(set(self.card.models) - set(names))
            log.info("models held here changed: %s", ", ".join(
                [*(f"+{n}" for n in added), *(f"-{n}" for n in gone)]
            ))  # fmt: skip
            kept = [f for f in self.card.model_facts if f.name in names]
            self.update_card(models=names, model_facts=kept)
            await self.advertise_facts(read)

    async def advertise_facts(self, read: Callable[[str], Awaitable[ModelFacts]]) -> None:
        """Put the facts of the models this node holds in its card (read once, cached on
        disk), so that a node without the file can place one of them on the nodes that
        hold it.

        Hashing a large model takes minutes: the facts read so far are published every
        :data:`FACTS_PUBLISH_S`, not only after the last model. Facts that would make
        the card larger than peers accept are left out (the name stays listed)."""
        found: list[ModelFacts] = []
        budget = VALUE_CAPS[NODE] - CARD_HEADROOM
        published = time.monotonic()
        too_big = 0
        unread: set[str] = set()
        for m in list(self.card.models):
            try:
                f = await read(m)
            except Exception as e:  # a file that is no usable model: nothing to say
                log.debug("no facts for %s: %s", m, e)
                unread.add(m)
                continue
            if len(encode(msgspec.structs.replace(self.card, model_facts=[*found, f]))) > budget:
                too_big += 1
                continue
            found.append(f)
            if time.monotonic() - published >= FACTS_PUBLISH_S:
                self.update_card(model_facts=list(found))
                published = time.monotonic()
        if too_big:
            log.warning(
                "the facts of %d models do not fit in this node's card: a node without "
                "their files cannot place them", too_big,
            )  # fmt: skip
        self._unread = unread
        if found and found != self.card.model_facts:
            self.update_card(model_facts=found)

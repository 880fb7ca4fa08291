"""Bonjour / mDNS discovery of meshd peers (zeroconf, on the caller's asyncio loop).

Each node registers one ``_meshd._tcp.local.`` service named after its node id and
browses for the others. A resolved peer in the same cluster becomes a ``PeerAddr``
handed to ``on_peer``; that is all discovery does. It does not connect to anyone.

TXT records carry only public facts: ``id`` (node id), ``c`` (cluster id), ``cn`` (the
cluster's name), ``mesh``, ``join`` and ``api`` (ports), ``v`` (version) and ``name`` (a
human label). Never a secret: anyone on the link can read them.

Every meshd node resolved is also kept in :attr:`Discovery.sightings` (bounded, with
when it was last seen), the ones of other clusters too: ``meshctl doctor`` explains
with them why a node on the LAN is not in the cluster.

A node that is not in a cluster yet browses without registering and with no cluster
(``cluster_hash=None``): every meshd node it finds is reported, with its cluster, so
that it can ask one of them to let it in.

Usage::

    disc = Discovery(node_id=..., name="studio", cluster_hash=..., mesh_port=5550,
                     api_port=8080, version="0.1.0", addresses=local_addresses(),
                     on_peer=lambda p: print(p))
    await disc.start()
    ...
    await disc.stop()
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import msgspec
from zeroconf import (
    InterfaceChoice,
    IPVersion,
    ServiceStateChange,
    Zeroconf,
)
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from meshd.transport.addresses import choose_address, local_addresses

log = logging.getLogger(__name__)

SERVICE_TYPE = "_meshd._tcp.local."

#: How long one resolution (SRV/TXT/A) of a browsed service may take.
RESOLVE_TIMEOUT_MS = 3000
#: Bound on each step of start/stop, so shutdown can never hang the node.
STEP_TIMEOUT_S = 3.0
#: TTL of our records. zeroconf's default for SRV/TXT/PTR is 4500 s (75 min), so a
#: peer that died without a goodbye would linger that long; 120 s lets it age out in
#: about two minutes (the browser re-queries live records before they expire).
RECORD_TTL_S = 120
#: DNS labels and TXT entries are length limited (63 and 255 bytes).
_MAX_LABEL = 63
_MAX_TXT_VALUE = 200
#: Nodes kept in :attr:`Discovery.sightings` (the least recently seen go first).
MAX_SIGHTINGS = 64


class PeerAddr(msgspec.Struct, frozen=True):
    """Where to reach a discovered peer's mesh socket (and its join socket)."""

    node_id: str
    host: str
    port: int
    #: The peer's cluster id, and its join port (0 when it has none: an open cluster).
    cluster: str = ""
    join: int = 0


class Sighting(msgspec.Struct, kw_only=True):
    """A meshd node Bonjour resolved, whatever its cluster."""

    node_id: str
    name: str
    host: str
    port: int
    #: Its TXT ``c`` and ``cn``; ``version`` its TXT ``v``.
    cluster: str
    cluster_name: str
    version: str
    #: Of this node's cluster: handed to ``on_peer``.
    same_cluster: bool
    #: ``time.monotonic()`` when it was last resolved.
    seen: float
    #: Still advertised (no goodbye or expiry since).
    present: bool = True


def _label(node_id: str) -> str:
    """A DNS-safe label (host name / instance name) that is unique per node id."""
    safe = re.sub(r"[^A-Za-z0-9-]", "-", node_id).strip("-") or "node"
    if safe != node_id or len(safe) > _MAX_LABEL:
        digest = hashlib.sha1(node_id.encode()).hexdigest()[:10]
        safe = f"{safe[: _MAX_LABEL - 11]}-{digest}"
    return safe


def _truncate_utf8(text: str, limit: int) -> str:
    return text.encode()[:limit].decode(errors="ignore")


class Discovery:
    """Advertise this node over mDNS and report peers of the same cluster.

    ``addresses`` are this node's own addresses: the non-loopback ones are advertised
    (all of them if there is no other), and all of them are used by
    :func:`choose_address` to pick which of a peer's addresses to report.
    ``on_peer`` is called on the event loop, once per peer and again whenever that
    peer's (host, port) changes. ``on_peer_lost`` (optional) is called with a node id
    when its service goes away (goodbye or TTL expiry). ``interfaces`` is a list of
    interface IPs for zeroconf; ``None`` means every interface.
    """

    def __init__(
        self,
        *,
        node_id: str,
        name: str,
        cluster_hash: str | None,
        mesh_port: int,
        api_port: int,
        version: str,
        addresses: list[str],
        on_peer: Callable[[PeerAddr], None],
        interfaces: list[str] | None = None,
        on_peer_lost: Callable[[str], None] | None = None,
        join_port: int = 0,
        register: bool = True,
        cluster_name: str = "",
    ) -> None:
        self.node_id = node_id
        self.join_port = join_port
        #: False: browse only (a node that is not in a cluster yet announces nothing).
        self.register = register
        self.name = name
        self.cluster_hash = cluster_hash
        self.cluster_name = cluster_name
        self.mesh_port = mesh_port
        self.api_port = api_port
        self.version = version
        self.addresses = list(addresses) or local_addresses()
        self.on_peer = on_peer
        self.on_peer_lost = on_peer_lost
        self.interfaces = interfaces
        #: Services of our type that belong to another cluster (counted once each).
        self.ignored_other_cluster = 0
        #: Services whose TXT records could not be understood.
        self.malformed = 0
        #: Service name -> the node it advertises (any cluster), least recently seen first.
        self.sightings: OrderedDict[str, Sighting] = OrderedDict()
        #: ``time.monotonic()`` when browsing started (None: not started).
        self.started_at: float | None = None

        self.service_name = f"{_label(node_id)}.{SERVICE_TYPE}"
        self._peers: dict[str, PeerAddr] = {}
        self._names: dict[str, str] = {}  # service name -> node id
        self._foreign: set[str] = set()  # service names of other clusters
        self._resolving: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._started = False
        self._stopped = False

    @property
    def peers(self) -> dict[str, PeerAddr]:
        """The peers currently known, by node id (a copy)."""
        return dict(self._peers)

    def _service_info(self) -> AsyncServiceInfo:
        routable = [a for a in self.addresses if not a.startswith("127.")]
        advertised = routable or self.addresses
        properties = {
            "id": self.node_id,
            "c": self.cluster_hash,
            "cn": _truncate_utf8(self.cluster_name, _MAX_TXT_VALUE),
            "mesh": str(self.mesh_port),
            "join": str(self.join_port),
            "api": str(self.api_port),
            "v": _truncate_utf8(self.version, _MAX_TXT_VALUE),
            "name": _truncate_utf8(self.name, _MAX_TXT_VALUE),
        }
        return AsyncServiceInfo(
            SERVICE_TYPE,
            self.service_name,
            port=self.mesh_port,
            properties=properties,
            server=f"{_label(self.node_id)}.local.",
            host_ttl=RECORD_TTL_S,
            other_ttl=RECORD_TTL_S,
            parsed_addresses=advertised,
        )

    async def start(self) -> None:
        """Register our service and start browsing. Returns once announced.

        Raises (after cleaning up) if zeroconf cannot start here, e.g. no usable
        interface or no multicast; the node can still run on static peers.
        """
        if self._started:
            raise RuntimeError("Discovery already started")
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self.stop()  # leave no sockets or tasks behind a failed start
            raise

    async def _start(self) -> None:
        interfaces = InterfaceChoice.All if self.interfaces is None else list(self.interfaces)
        self._aiozc = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
        # Browse first: peers' answers arrive while our own probing runs.
        self._browser = AsyncServiceBrowser(
            self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_state_change]
        )
        self.started_at = time.monotonic()
        if not self.register:
            return
        self._info = self._service_info()
        announced = await asyncio.wait_for(
            self._aiozc.async_register_service(self._info, allow_name_change=True),
            STEP_TIMEOUT_S,
        )
        self.service_name = self._info.name  # zeroconf renames it on a name conflict
        await asyncio.wait_for(announced, STEP_TIMEOUT_S)

    async def stop(self) -> None:
        """Say goodbye (peers see us go), stop browsing, close zeroconf.

        Idempotent, and every step is bounded by a timeout.
        """
        if self._stopped:
            return
        self._stopped = True
        for task in list(self._resolving.values()):
            task.cancel()
        self._resolving.clear()
        aiozc, browser, info = self._aiozc, self._browser, self._info
        self._browser = self._info = None
        if browser is not None:
            await self._bounded(browser.async_cancel(), "cancel browser")
        if aiozc is None:
            return
        if info is not None:

            async def unregister() -> None:
                done = await aiozc.async_unregister_service(info)
                await done

            await self._bounded(unregister(), "unregister service")
        await self._bounded(aiozc.async_close(), "close zeroconf")

    @staticmethod
    async def _bounded(aw: Awaitable[object], what: str) -> None:
        try:
            await asyncio.wait_for(aw, STEP_TIMEOUT_S)
        except TimeoutError:
            log.warning("discovery: %s timed out after %.0f s", what, STEP_TIMEOUT_S)
        except Exception:
            log.warning("discovery: %s failed", what, exc_info=True)

    # -- browsing --------------------------------------------------------------------

    def _on_state_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        """Browser callback; runs on the event loop and must not block."""
        if self._stopped:
            return
        if state_change is ServiceStateChange.Removed:
            self._forget(name)
            return
        self._schedule(name)

    def _schedule(self, name: str) -> None:
        """Resolve ``name``; if a resolution is already in flight, redo it after."""
        if name in self._resolving:
            self._again.add(name)
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name))
        self._resolving[name] = task
        task.add_done_callback(functools.partial(self._resolved, name))

    def _resolved(self, name: str, task: asyncio.Task[None]) -> None:
        if self._resolving.get(name) is task:
            del self._resolving[name]
        if name in self._again and not self._stopped:
            self._again.discard(name)
            self._schedule(name)

    async def _resolve(self, name: str) -> None:
        if self._aiozc is None:
            return
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        try:
            found = await info.async_request(self._aiozc.zeroconf, RESOLVE_TIMEOUT_MS)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.debug("discovery: resolving %s failed", name, exc_info=True)
            return
        if not found or self._stopped:
            log.debug("discovery: %s did not resolve in time", name)
            return
        self._accept(name, info)

    def _accept(self, name: str, info: AsyncServiceInfo) -> None:
        props = info.decoded_properties
        node_id = props.get("id")
        try:
            port = int(props.get("mesh") or "")
        except ValueError:
            port = 0
        if not node_id or not 0 < port < 65536:
            self.malformed += 1
            log.debug("discovery: %s has malformed TXT %r", name, props)
            return
        if node_id == self.node_id:
            return
        cluster = props.get("c") or ""
        addrs = info.parsed_addresses(IPVersion.V4Only) or info.parsed_addresses()
        same = self.cluster_hash is None or cluster == self.cluster_hash
        self._sighted(name, props, node_id, addrs, port, cluster, same)
        if not same:
            if name not in self._foreign:
                self._foreign.add(name)
                self.ignored_other_cluster += 1
            return
        if not addrs:
            log.debug("discovery: %s advertises no address", name)
            return
        try:
            join = int(props.get("join") or 0)
        except ValueError:
            join = 0
        peer = PeerAddr(
            node_id=node_id,
            host=choose_address(self.addresses, addrs),
            port=port,
            cluster=cluster,
            join=join if 0 < join < 65536 else 0,
        )
        self._names[name] = node_id
        if self._peers.get(node_id) == peer:
            return
        self._peers[node_id] = peer
        try:
            self.on_peer(peer)
        except Exception:
            log.exception("discovery: on_peer callback failed for %s", peer)

    def _sighted(
        self,
        name: str,
        props: dict[str, str | None],
        node_id: str,
        addrs: list[str],
        port: int,
        cluster: str,
        same: bool,
    ) -> None:
        """Keep what the advert said (bounded: the least recently seen node goes)."""
        self.sightings.pop(name, None)
        self.sightings[name] = Sighting(
            node_id=node_id,
            name=(props.get("name") or "")[:_MAX_TXT_VALUE],
            host=choose_address(self.addresses, addrs) if addrs else "",
            port=port,
            cluster=cluster,
            cluster_name=(props.get("cn") or "")[:_MAX_TXT_VALUE],
            version=(props.get("v") or "")[:_MAX_TXT_VALUE],
            same_cluster=same,
            seen=time.monotonic(),
        )
        while len(self.sightings) > MAX_SIGHTINGS:
            self.sightings.popitem(last=False)

    def _forget(self, name: str) -> None:
        if name in self.sightings:
            self.sightings[name].present = False
        self._again.discard(name)
        self._foreign.discard(name)
        task = self._resolving.pop(name, None)
        if task is not None:
            task.cancel()
        node_id = self._names.pop(name, None)
        if node_id is None or node_id in self._names.values():
            return
        self._peers.pop(node_id, None)
        if self.on_peer_lost is not None:
            try:
                self.on_peer_lost(node_id)
            except Exception:
                log.exception("discovery: on_peer_lost callback failed for %s", node_id)

"""The facts :func:`meshd.node.diagnosis.diagnose` reads (a :class:`Snapshot`, as plain
values the node gathered at the edge) and the report it writes (:class:`Report`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from meshd.crdt.hlc import DEFAULT_MAX_DRIFT_MS

from .cluster import ClusterView
from .dependencies import Untested

__all__ = [
    "Checked",
    "Finding",
    "Interface",
    "PortCheck",
    "Refusal",
    "Report",
    "Severity",
    "Sighting",
    "Snapshot",
    "TwinSeen",
    "Waiting",
]

Severity = Literal["error", "warning", "info"]


class Finding(msgspec.Struct, kw_only=True, frozen=True):
    """One thing wrong (or worth knowing), and the one-line fix."""

    severity: Severity
    #: A stable name for scripts (``other_cluster``, ``ports_closed``, ...).
    code: str
    what: str
    fix: str


class Checked(msgspec.Struct, kw_only=True, frozen=True):
    """One thing the diagnosis examined, and what it saw (also when all was well)."""

    name: str
    detail: str


class Report(msgspec.Struct, kw_only=True):
    """The body of ``GET /v1/doctor``: findings, worst first, and what was checked."""

    node: str
    name: str
    findings: list[Finding]
    checked: list[Checked]


@dataclass(frozen=True)
class Sighting:
    """A meshd node this node's Bonjour browser resolved (kept after it went away)."""

    node_id: str
    name: str
    host: str
    port: int
    #: Its TXT ``c`` (the cluster's hash) and ``cn`` (its cluster's name, if it says).
    cluster: str
    cluster_name: str
    version: str
    #: In this node's cluster (same ``c``): handed to the gossip as a peer.
    same_cluster: bool
    #: Seconds since it was last resolved; still advertised (no goodbye, no expiry).
    age_s: float = 0.0
    present: bool = True


@dataclass(frozen=True)
class Refusal:
    """Someone this node turned away: at its join desk, or at ZAP (a CURVE key that is
    no member's), counted per address and reason."""

    address: str
    #: ``bad_proof``, ``wrong_code``, ``unknown_invite``, ``bad_request``, ``busy``,
    #: ``zap_denied``.
    reason: str
    name: str = ""
    node_id: str = ""
    count: int = 1
    #: Seconds since the last one.
    age_s: float = 0.0


@dataclass(frozen=True)
class Waiting:
    """A node waiting at this node's join desk for a member's approval."""

    node_id: str
    name: str
    address: str
    waiting_s: float


@dataclass(frozen=True)
class PortCheck:
    """How one port of a peer answered a probe from this node."""

    node: str
    #: ``mesh``, ``pub`` or ``data``.
    port_name: str
    host: str
    port: int
    #: ``ok`` (the handshake completed), ``handshake_failed`` (it answers, the
    #: handshake fails), ``no_answer`` (no connection within the probe's time).
    outcome: str
    detail: str = ""


@dataclass(frozen=True)
class TwinSeen:
    """Another process that wrote under this node's id."""

    name: str
    address: str
    age_s: float
    #: It answered a hello under our id (a live twin), not only a card was seen.
    confirmed: bool


@dataclass(frozen=True)
class Interface:
    """One IPv4 address of this host, on its interface."""

    name: str
    address: str
    prefix: int


@dataclass(frozen=True)
class Snapshot:
    """Everything :func:`diagnose` looks at, as plain values."""

    view: ClusterView
    name: str
    version: str
    cluster: str
    secured: bool = True
    #: Bonjour: ``off`` (--no-discovery), ``failed`` (could not start) or ``on``.
    discovery: str = "on"
    discovery_s: float = 0.0
    #: Node ids of this cluster Bonjour found (and handed to the gossip).
    bonjour_peers: frozenset[str] = frozenset()
    sightings: tuple[Sighting, ...] = ()
    malformed_adverts: int = 0
    #: ``--peer`` seeds, as ``host:port``.
    seeds: tuple[str, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    waiting: tuple[Waiting, ...] = ()
    #: Failed CURVE handshakes on this node's bound sockets, by socket (libzmq does not
    #: say from where).
    handshake_failures: Mapping[str, int] = field(default_factory=dict)
    ports: tuple[PortCheck, ...] = ()
    probe_timeout_s: float = 0.0
    twins: tuple[TwinSeen, ...] = ()
    #: Entries under this node's id written elsewhere, refused since start.
    own_id_refused: int = 0
    #: Entries refused since start for a stamp too far ahead of this node's clock.
    clock_drift_refused: int = 0
    max_drift_ms: int = DEFAULT_MAX_DRIFT_MS
    #: Node id -> how far its last heartbeat's stamp ran ahead of this node's clock
    #: when it arrived (ms; negative: behind, or only the travel time).
    clock_ahead_ms: Mapping[str, int] = field(default_factory=dict)
    interfaces: tuple[Interface, ...] = ()
    advertised: tuple[str, ...] = ()
    #: Node id -> the host this node dials it at.
    dialled: Mapping[str, str] = field(default_factory=dict)
    disk_path: str = ""
    disk_free: int | None = None
    #: Installed packages meshd reaches into, outside the range it was tested with.
    untested: tuple[Untested, ...] = ()


# -- helpers ---------------------------------------------------------------------------

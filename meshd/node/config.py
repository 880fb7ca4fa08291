"""Node settings: every default in one place (documented in docs/operations.md)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from meshd.crdt import liveness
from meshd.engines.models import DEFAULT_MODEL
from meshd.transport import gossip

from .identity import default_data_dir

#: The OpenAI-compatible HTTP API.
DEFAULT_API_PORT = 7470
#: The mesh ROUTER (hello, anti-entropy); what ``--peer HOST:PORT`` names.
DEFAULT_MESH_PORT = 7471
DEFAULT_CLUSTER = "default"
HEARTBEAT_INTERVAL = 0.5
#: Tombstones are collected this far behind the cluster's stable horizon (clock skew).
TOMBSTONE_GRACE_MS = 60_000


@dataclass
class NodeConfig:
    """What ``meshd up`` was asked for."""

    name: str = field(default_factory=socket.gethostname)
    cluster: str = DEFAULT_CLUSTER
    api_host: str = "127.0.0.1"
    api_port: int = DEFAULT_API_PORT
    mesh_host: str = "0.0.0.0"
    mesh_port: int = DEFAULT_MESH_PORT
    peers: list[tuple[str, int]] = field(default_factory=list)
    data_dir: Path = field(default_factory=default_data_dir)
    discovery: bool = True
    #: Addresses to advertise; empty = this host's interface addresses.
    advertise: list[str] = field(default_factory=list)
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    digest_interval: float = gossip.DIGEST_INTERVAL
    request_timeout: float = gossip.REQUEST_TIMEOUT
    hello_interval: float = gossip.HELLO_INTERVAL
    suspect_after: float = liveness.SUSPECT_AFTER
    dead_after: float = liveness.DEAD_AFTER
    tombstone_grace_ms: int = TOMBSTONE_GRACE_MS
    #: Model to make sure the cluster serves; "" for none.
    model: str = DEFAULT_MODEL
    #: Seconds to wait for peers before placing ``model`` (so a joiner does not re-place).
    settle_s: float = 2.0
    #: Context (tokens) per request, and requests in flight, per runner.
    n_ctx: int = 4096
    n_seq_max: int = 8
    #: Most memory (bytes) this node offers the cluster; 0 = what the machine has.
    max_memory: int = 0


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``512M``, ``8GiB``, ``1.5g`` or a plain byte count -> bytes (binary units)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    num = t.rstrip("kmgt")
    unit = t[len(num) :]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"size {text!r}: expected a number with an optional K/M/G/T") from None
    if value < 0 or unit not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional K/M/G/T")
    return int(value * _UNITS[unit])


def parse_peer(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``, or ``HOST`` for the default mesh port)."""
    t = text.strip()
    if t.startswith("["):
        host, _, rest = t[1:].partition("]")
        port = rest.lstrip(":")
    elif t.count(":") == 1:
        host, port = t.split(":")
    else:
        host, port = t, ""
    if not host:
        raise ValueError(f"peer {text!r}: missing host")
    if not port:
        return host, DEFAULT_MESH_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer {text!r}: port must be 1-65535")
    return host, int(port)

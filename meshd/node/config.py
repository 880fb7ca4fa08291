"""Node settings: every default in one place, each with its reason (documented in
docs/operations.md). ``meshd up`` fills a :class:`NodeConfig` from its flags; the parts
of the node read their numbers from it, never from constants of their own."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from meshd.crdt import hlc, liveness
from meshd.domain.keepalive import DEFAULT_KEEP_ALIVE_S
from meshd.engines.protocol import REQUEST_EXPIRY_S, STREAM_INTERVAL_S
from meshd.models import DEFAULT_MODEL
from meshd.placement.policy import KV_SEQUENCES, KV_TOKENS
from meshd.transport import gossip

from .local import cache_dir_for, default_data_dir

#: The OpenAI-compatible HTTP API.
DEFAULT_API_PORT = 7470
#: The mesh ROUTER (hello, anti-entropy); what ``--peer HOST:PORT`` names.
DEFAULT_MESH_PORT = 7471
DEFAULT_CLUSTER = "default"
HEARTBEAT_INTERVAL = 0.5
#: Requests in flight per node before the API answers 429 (8 runner slots, 8x queued).
DEFAULT_MAX_REQUESTS = 64
#: ``max_tokens`` cap; unset ``max_tokens`` also stops here (or at the context's end).
DEFAULT_MAX_TOKENS = 4096
#: Tombstones are collected this far behind the cluster's stable horizon (clock skew).
TOMBSTONE_GRACE_MS = 60_000
#: A node silent (dead or left) this long is forgotten: it stops counting for tombstone
#: collection (a dead member freezes it) and survivors tombstone its card and heartbeat.
FORGET_AFTER_S = 600.0
#: A request waits this long for its model to load, then gets 503 + Retry-After: a
#: first load of a big model takes tens of seconds, and a client should hear something.
LOAD_WAIT_S = 60.0
#: Stage 0 answers every request with its prompt size first; no answer this long means
#: the pipeline is not there (a runner wedged without dying).
FIRST_CHUNK_TIMEOUT_S = 30.0
#: Seconds added to the wait for a request's first token per prompt token: a long
#: prompt's prefill sends nothing until it is done (a 7,900-token prompt of the 135M
#: model takes 34 s on 2 CPU cores, its attention growing with the prompt), and a
#: slower machine or bigger model takes longer still. A dead stage is still found at
#: once (its node's liveness), so this only bounds a wedged runner.
PREFILL_S_PER_TOKEN = 0.02
#: Silence between two chunks of a request before it ends with ``timeout``: far above
#: any token time, below the runners' request expiry (the API node gives up first).
CHUNK_TIMEOUT_S = 30.0
#: A stage whose node is merely *suspect* ends a request that has also been silent
#: this long: a healthy pipeline keeps producing, so both together mean it is gone.
SUSPECT_SILENCE_S = 1.0
#: How long a broken request waits for its repaired instance to serve before it ends
#: with ``stage_lost``. A repair that placement says is impossible ends it at once;
#: this bounds a repair that is possible but slow (weights loading on the new node).
REPLAY_WAIT_S = 30.0
#: While a streamed request waits for its repair, an SSE comment goes out this often
#: so that clients and proxies with idle timeouts keep the connection.
KEEPALIVE_S = 1.0
#: Replays one request may go through: a drain and a repair can follow each other,
#: but a plan that keeps changing under a request must not keep it forever.
MAX_REPLAYS = 4
#: Survivors re-place the instances of dead nodes at least this often (and at once on
#: a change of the cluster).
REPAIR_INTERVAL_S = 0.5
#: A runner gets this long to exit after SIGTERM before SIGKILL: it frees its KV and
#: closes its sockets; a wedged engine call must not hold a plan change up.
STOP_GRACE_S = 3.0
#: Crash-loop breaker: more than this many unexpected exits within the window and the
#: runner is given up (``failed``, reason ``crash loop``); placement then moves it.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0
#: First restart delay, doubled at each restart (a crash at load must not spin).
RESTART_BACKOFF_S = 0.5
#: Stages one node runs at most, whatever the plans say (a plan is any member's word).
MAX_RUNNERS = 16
#: Bytes of cached GGUF slices kept beyond those in use (least recently used go first).
SLICE_CACHE_BYTES = 16 << 30
#: How often a node looks again for the models it holds (one pulled or copied in since
#: shows up in every node's list within this; a scan lists names, it hashes nothing new
#: until the model's facts are read).
MODELS_RESCAN_S = 30.0
#: How long a stopping node waits for its stages to move and its requests to finish.
DRAIN_TIMEOUT_S = 30.0
#: After the drain, the API server's grace for responses still being written.
API_STOP_GRACE_S = 5.0
#: Seconds to wait for peers before placing the default model, so a node joining a
#: cluster that already serves it does not place it again.
SETTLE_S = 2.0


@dataclass
class NodeConfig:
    """What ``meshd up`` was asked for."""

    name: str = field(default_factory=socket.gethostname)
    cluster: str = DEFAULT_CLUSTER
    #: API listen address; None = loopback, or all interfaces when an API key is set.
    api_host: str | None = None
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
    #: Seconds of silence after which a dead or departed node is forgotten.
    forget_after: float = FORGET_AFTER_S
    #: Seconds a request broken by a fault waits for its repaired plan to serve.
    replay_wait: float = REPLAY_WAIT_S
    load_wait: float = LOAD_WAIT_S
    #: Seconds an instance stays loaded after its last request unless the request said
    #: (``keep_alive``; ``math.inf``: forever; see ``meshd.domain.keepalive``).
    keep_alive: float = DEFAULT_KEEP_ALIVE_S
    models_rescan: float = MODELS_RESCAN_S
    first_chunk_timeout: float = FIRST_CHUNK_TIMEOUT_S
    chunk_timeout: float = CHUNK_TIMEOUT_S
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN
    suspect_silence: float = SUSPECT_SILENCE_S
    keepalive: float = KEEPALIVE_S
    max_replays: int = MAX_REPLAYS
    repair_interval: float = REPAIR_INTERVAL_S
    #: A runner frees a request idle this long (its stage 0 died, no cancel can come);
    #: above ``chunk_timeout`` so that the API node gives up on a silent pipeline first.
    request_expiry: float = REQUEST_EXPIRY_S
    #: Longest a generated token waits at its last stage to go with the next ones in
    #: one message (seconds; 0: every token alone; see meshd.engines.outbox).
    stream_interval: float = STREAM_INTERVAL_S
    stop_grace: float = STOP_GRACE_S
    max_restarts: int = MAX_RESTARTS
    max_runners: int = MAX_RUNNERS
    slice_cache: int = SLICE_CACHE_BYTES
    restart_window: float = RESTART_WINDOW_S
    restart_backoff: float = RESTART_BACKOFF_S
    drain_timeout: float = DRAIN_TIMEOUT_S
    api_stop_grace: float = API_STOP_GRACE_S
    #: How far (ms) a peer's clock may run ahead of ours before its entries are refused.
    max_clock_drift_ms: int = hlc.DEFAULT_MAX_DRIFT_MS
    #: Model to make sure the cluster serves; "" for none.
    model: str = DEFAULT_MODEL
    #: Folders whose models this node may load (``--models DIR``), beside its packaged
    #: aliases, the HF cache, and paths given on its command line or through its API.
    model_dirs: list[Path] = field(default_factory=list)
    #: Seconds to wait for peers before placing ``model`` (so a joiner does not re-place).
    settle_s: float = SETTLE_S
    #: Context (tokens) per request, and requests in flight, per runner: what
    #: placement reserves KV memory for, so they share its constants.
    n_ctx: int = KV_TOKENS
    n_seq_max: int = KV_SEQUENCES
    #: Context (tokens) of the models this node places when nothing else says one
    #: (``--context``): a cap on their KV memory; 0: placement's memory-chosen default.
    context: int = 0
    #: Most memory (bytes) this node offers the cluster; 0 = what the machine has.
    max_memory: int = 0
    #: The cluster's secret (``--secret-file``): a node holding it is a member at once.
    secret: str | None = None
    #: A pairing code from ``meshctl invite`` (``--join``): how a new node gets in.
    join_code: str | None = None
    #: Today's open lab cluster (``--open``): no keys, anyone on the LAN joins.
    open: bool = False
    #: Bearer token inference and reading demand; None serves anyone who can reach it.
    api_key: str | None = None
    #: Key that opens administration from anywhere (``x-meshd-admin``); None: only the
    #: owner token in the data dir, from this machine.
    admin_key: str | None = None
    #: More names the API answers to (a reverse proxy's, a DNS name): the Host and
    #: Origin checks refuse names that are not this node's own.
    allow_hosts: list[str] = field(default_factory=list)
    #: Completion requests in flight through this node's API; more get 429.
    max_requests: int = DEFAULT_MAX_REQUESTS
    #: Most tokens one request may generate (``max_tokens`` above it is a 400).
    max_tokens: int = DEFAULT_MAX_TOKENS
    #: Gossip messages and mesh requests a second one peer may send.
    peer_rate: float = gossip.PEER_RATE

    @property
    def cache_dir(self) -> Path:
        """Where slices of models (cut here or fetched) and hashes are cached
        (:func:`~meshd.node.local.cache_dir_for`)."""
        return cache_dir_for(self.data_dir)

    def api_listen_host(self) -> str:
        """Where the API binds: as told, else all interfaces when a key guards it, else
        loopback (an unguarded API is never exposed by default)."""
        if self.api_host:
            return self.api_host
        return "0.0.0.0" if self.api_key else "127.0.0.1"


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

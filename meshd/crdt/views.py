"""Typed views over the LWW-map: the key spaces and the Structs stored under them.

| key               | value      | written by            |
|-------------------|------------|-----------------------|
| ``node/<id>``     | NodeCard   | node ``<id>`` only    |
| ``health/<id>``   | Health     | node ``<id>`` only    |
| ``instance/<id>`` | Instance   | any member            |
| ``member/<id>``   | Member     | any member            |

Values are msgpack-encoded Structs; a value that fails to decode is skipped by the
views (and never crashes a reader), so an old node cannot break a new one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Literal, TypeVar

import msgspec

from meshd.domain.facts import ModelFacts
from meshd.domain.keepalive import Awake
from meshd.domain.nodes import Device, NodeResources

from .lww import Entry, LWWMap

NODE = "node/"
HEALTH = "health/"
INSTANCE = "instance/"
MEMBER = "member/"
#: Every key space the cluster knows; a key outside them is refused.
KEY_SPACES = (NODE, HEALTH, INSTANCE, MEMBER)


def node_key(node_id: str) -> str:
    """Key of a node's capability card."""
    return NODE + node_id


def health_key(node_id: str) -> str:
    """Key of a node's heartbeat."""
    return HEALTH + node_id


def instance_key(instance_id: str) -> str:
    """Key of a placed model instance."""
    return INSTANCE + instance_id


def member_key(node_id: str) -> str:
    """Key of a member's entry (its public key)."""
    return MEMBER + node_id


class Member(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A node the cluster admits: its Ed25519 public key, and who let it in.

    ``id`` must be the node id that ``key`` gives. An entry is taken when its writer is
    already a member (an approval), or when ``proof`` shows a holder of the cluster key
    vouches for ``key`` (a node started with the cluster's secret file).
    """

    id: str
    name: str
    key: bytes
    #: The member that approved it, or ``id`` itself with a ``proof``.
    by: str
    at_ms: int = 0
    proof: bytes = b""
    #: May remove members and make owners (the cluster's first node; see
    #: ``meshd.node.trust``). A cluster from before the flag has no owner: then every
    #: member counts as one.
    owner: bool = False


class NodeCard(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What a node can do, written once at start (and when it changes)."""

    id: str
    name: str
    #: Random per process start: tells a restart apart, and exposes duplicated ids.
    incarnation: str
    cluster: str
    version: str
    os: str
    arch: str
    cpu_count: int
    mem_total: int
    mem_available: int
    #: Engine backends detected on this machine, e.g. ``llama_cpp-cpu``, ``mlx-metal``.
    backends: list[str] = []
    #: The GPUs those backends compute on, with their memory when probed.
    devices: list[Device] = []
    #: Addresses peers may reach this node at, best first.
    addresses: list[str] = []
    mesh_port: int
    pub_port: int
    api_port: int
    api_host: str = ""
    #: ROUTER where this node receives DataChunks for the requests its API owns.
    data_port: int = 0
    #: ROUTER where this node serves slices of the models it holds (0: serves none).
    weights_port: int = 0
    #: Models this node holds on local disk (aliases or paths).
    models: list[str] = []
    started_ms: int = 0
    #: Facts of the models it read (its default model): a node without the file can
    #: still place one of them, on the nodes that hold it.
    model_facts: list[ModelFacts] = []


#: ``unloaded``: the instance idled past its keep-alive: no process runs it here until a
#: request wakes it (see ``meshd.domain.keepalive``).
RunnerStateName = Literal["fetching", "loading", "ready", "failed", "stopped", "unloaded"]


class RunnerStatus(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """State of one runner subprocess, as reported by the node that runs it."""

    instance: str
    generation: int
    #: Index of the stage in the instance's plan.
    stage: int = 0
    state: RunnerStateName
    reason: str = ""
    #: The runner's ROUTER port (on the node's addresses); 0 until it listens.
    port: int = 0
    #: Requests holding a KV sequence on this runner right now, and (stage 0) those
    #: queued for one.
    active: int = 0
    waiting: int = 0
    #: While ``fetching`` (the stage's slice from the nodes that hold the model): bytes
    #: verified so far, of ``fetch_total``, at ``fetch_rate`` bytes per second.
    fetched: int = 0
    fetch_total: int = 0
    fetch_rate: float = 0.0


HealthState = Literal["up", "draining", "stopped"]


class ModelSpeed(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """How one instance's requests through one node's API went over the last minute
    (``meshd.node.speed``): what ``meshctl top`` adds up across nodes."""

    #: Tokens per second streamed to clients (over the last 10 s).
    tokens_s: float = 0.0
    in_flight: int = 0
    #: Medians, in milliseconds: time to first token, between tokens, each stage's
    #: compute per step (stage order) and the overhead of one hop.
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    stage_ms: list[float] = []
    hop_ms: float = 0.0


class Health(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A heartbeat. Liveness is judged by when a reader *received* a newer one."""

    seq: int
    state: HealthState = "up"
    mem_available: int = 0
    load: float = 0.0
    queue_depth: int = 0
    #: Bytes of weights a decode step reads per second on this node, as its runners
    #: measure it (placement's speed figure; 0: not measured yet).
    decode_bps: float = 0.0
    #: Round trip (ms) to each peer it exchanged mesh requests with (the least of the
    #: recent ones: the link, not the peer's work), by node id.
    rtt_ms: dict[str, float] = {}
    #: Bandwidth (Mbit/s) of the link to each peer it measured (``meshd.transport.links``),
    #: by node id. A peer absent (a node of an older meshd sends none) is unknown, not 0.
    bw_mbps: dict[str, float] = {}
    #: The node's anti-entropy horizon (see ``meshd.crdt.lww.stable_horizon``).
    synced: int = 0
    runners: list[RunnerStatus] = []
    #: Tokens per second this node's API streams now (its requests, every model).
    tokens_s: float = 0.0
    #: Per instance (by id): the speed of this node's requests over the last minute.
    #: (A node of an older meshd keys them by model name: no instance id matches
    #: such an entry, so its figures are left out rather than shown under both.)
    serving: dict[str, ModelSpeed] = {}
    #: Per instance (by id) this node's API sent requests to: until when it wants it
    #: loaded, and whether a request of its runs on it now (``meshd.domain.keepalive``).
    awake: dict[str, Awake] = {}


class Stage(msgspec.Struct, kw_only=True, frozen=True):
    """One pipeline stage: layers ``[start, end)`` of a model on one node."""

    node: str
    start: int
    end: int
    engine: str


class InstanceSpec(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What a user asked for when placing a model."""

    model: str
    min_nodes: int = 1
    nodes: list[str] = []
    engines: list[str] = []
    #: Wire type of the hidden rows between stages (``f16`` default, ``bf16``,
    #: ``f32``): half the bytes of float32 on every hop. A request in the exact mode
    #: sends float32 whatever this says (:mod:`meshd.domain.exact`).
    activations: str = "f16"
    #: Tokens of context each request gets (prompt + answer); 0: the default (the
    #: model's trained context as far as memory allows, see
    #: ``meshd.placement.place.default_context``). Placement reserves KV for it on
    #: every stage, and the runners allocate it.
    context: int = 0
    #: KV cache type of its llama.cpp stages: ``f16``, ``q8_0`` or ``q4_0`` (about
    #: 0.53x and 0.28x the bytes: a longer context in the same memory).
    kv_cache: str = "f16"
    #: Requests each runner holds KV for at once (0: ``placement.policy.KV_SEQUENCES``,
    #: 8); placement reserves KV for every one of them on every stage, so more seats
    #: take more memory, and a split keeps more requests in flight (its stages step
    #: micro-batches of them at once).
    seats: int = 0
    #: Which placed model drafts for it (speculative decoding): "" any that fits
    #: (see ``meshd.placement.drafts``), a model name that one only, ``none`` none.
    draft: str = ""
    #: Whether its requests that do not say speculate: None as the runner decides
    #: (sampled unseeded requests on a split), True all of them, False none. A request's
    #: own ``speculate`` overrides it.
    speculate: bool | None = None
    #: The exact mode for its requests that do not say ``exact``
    #: (:mod:`meshd.domain.exact`): no prefix reuse, no speculation, float32 hops.
    exact: bool = False
    #: Node ids the owner keeps this model off: placement never gives them a stage of
    #: it, a repair included (see ``meshd.placement.place``).
    exclude: list[str] = []

    def relaxed(self) -> InstanceSpec:
        """What a repair places: the model, its context, KV cache type, seats, draft model,
        speculation default, exact mode and excluded nodes, no pins (a repair serves with the nodes
        left rather than not at all)."""
        return InstanceSpec(
            model=self.model, context=self.context, kv_cache=self.kv_cache, seats=self.seats,
            draft=self.draft, speculate=self.speculate, exact=self.exact, exclude=self.exclude,
        )  # fmt: skip


class NodeSource(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Where one node's figures in a plan's basis come from, as that node signed them:
    the clock of its card entry, and its heartbeat entry itself (signature included),
    so any node can derive the figures again (``meshd.node.plan_basis``)."""

    card: int
    health: Entry


class PlanBasis(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What a plan was computed from: the spec placement got (a repair relaxes pins),
    the nodes as it saw them, the stages it repaired, and each node's signed sources
    (parallel to ``nodes``). Any node can compute the plan again from these and refuse
    one that does not come out the same (``meshd.node.plans``)."""

    spec: InstanceSpec
    nodes: list[NodeResources]
    previous: list[Stage] | None = None
    sources: list[NodeSource] = []


class Instance(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A placed model: its spec, its plan, the plan's generation and what it came from."""

    id: str
    spec: InstanceSpec
    stages: list[Stage]
    generation: int = 1
    facts: ModelFacts | None = None
    basis: PlanBasis | None = None
    #: Tokens of context each request gets, as placement chose them (the spec's, or
    #: the longest the plan's memory allows, see ``placement.default_context``); the
    #: runners allocate it. 0 in a record written before it was kept.
    context: int = 0
    #: The clock of its first placement, kept by its repairs and by a restore after a
    #: restart: with ``id``, which instance this is (``meshd.node.kept``: a removal
    #: names it). 0 in a record written before it was kept.
    placed: int = 0


_encoder = msgspec.msgpack.Encoder()
T = TypeVar("T", bound=msgspec.Struct)
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(value: msgspec.Struct) -> bytes:
    """Encode a view Struct as an LWW value."""
    return _encoder.encode(value)


def decode(value: bytes, typ: type[T]) -> T | None:
    """Decode an LWW value into a view Struct; None if it does not fit the schema."""
    dec: msgspec.msgpack.Decoder[T] | None = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ)
    try:
        return dec.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        # RecursionError: msgspec's answer to a value nested too deep (about 1 KiB of
        # nested arrays); it must not take the reader down either.
        return None


#: Per map, what each key's entry decoded to, kept while that very entry is the live
#: one. The views are read many times a second (liveness, repairs, drafts, the API)
#: and a value is only replaced, never changed in place, so each entry is decoded
#: once: decoding every card at every read cost a node with 100 members of 58 KB
#: cards most of a core (tests/node/test_bounds.py, the 6 MiB sync).
_decoded: weakref.WeakKeyDictionary[LWWMap, dict[str, tuple[Entry, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _view(m: LWWMap, prefix: str, typ: type[T]) -> Iterator[tuple[str, T, str]]:
    memo = _decoded.get(m)
    if memo is None or len(memo) > 2 * len(m) + 64:  # keys deleted and collected since
        memo = _decoded[m] = {k: v for k, v in (memo or {}).items() if m.get(k) is v[0]}
    for e in m.live(prefix):
        held = memo.get(e.key)
        if held is not None and held[0] is e:
            v = held[1]
        else:
            v = decode(e.value or b"", typ)
            memo[e.key] = (e, v)
        if v is not None:
            yield e.key[len(prefix) :], v, e.writer


def cards(m: LWWMap) -> dict[str, NodeCard]:
    """Node cards by node id. A card not written by its own node is ignored."""
    return {nid: c for nid, c, w in _view(m, NODE, NodeCard) if w == nid and c.id == nid}


def healths(m: LWWMap) -> dict[str, Health]:
    """Latest heartbeat by node id. A heartbeat not written by its own node is ignored."""
    return {nid: h for nid, h, w in _view(m, HEALTH, Health) if w == nid}


def instances(m: LWWMap) -> dict[str, Instance]:
    """Placed model instances by instance id."""
    return {iid: i for iid, i, _ in _view(m, INSTANCE, Instance) if i.id == iid}


def members(m: LWWMap) -> dict[str, Member]:
    """Members by node id (entries whose id does not match their key are left out by
    the trust rules before they get here)."""
    return {nid: x for nid, x, _ in _view(m, MEMBER, Member) if x.id == nid}

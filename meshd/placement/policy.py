"""The knobs placement runs with (:class:`Policy`, the engine ranking, the KV
reservation), and the small pure rules that read them alone: a node's GPU room for an
engine, an instance's context, a plan's digest and generation."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgspec

from meshd.crdt.views import Instance, Stage
from meshd.domain.facts import ModelFacts

from .errors import MiB
from .resources import NodeResources
from .support import backend_rank, engine_of

__all__ = [
    "DEFAULT_ENGINE_PREFERENCE",
    "KV_CACHE_TYPES",
    "KV_SEQUENCES",
    "KV_TOKENS",
    "MAX_SEATS",
    "Policy",
    "base_context",
    "instance_context",
    "instance_seats",
    "next_generation",
    "node_vram",
    "plan_digest",
    "with_context",
]

#: Backends ranked fastest first: a node runs the model on the engine of its
#: best-ranked backend that the model supports. MLX where it has a GPU (Metal, CUDA),
#: llama.cpp on a CPU-only machine (MLX's Linux CPU wheel is 7-50x slower).
DEFAULT_ENGINE_PREFERENCE: tuple[str, ...] = (
    "mlx-metal",
    "mlx-cuda",
    "llama_cpp-metal",
    "llama_cpp-cuda",
    "llama_cpp-vulkan",
    "llama_cpp-gpu",
    "llama_cpp-cpu",
    "mlx-cpu",
)


#: KV cache types of a llama.cpp stage (``InstanceSpec.kv_cache``) -> bytes of a KV
#: element relative to F16 (``ModelFacts.kv_bytes_per_token_layer`` counts F16): a Q8_0
#: block is 34 bytes for 32 elements, a Q4_0 block 18. MLX stages keep their own type.
KV_CACHE_TYPES = {"f16": 1.0, "q8_0": 34 / 64, "q4_0": 18 / 64}

#: Context (tokens) of one request and requests in flight that a runner makes room
#: for: the runner allocates exactly this KV cache, so placement reserves it.
#: ``KV_TOKENS`` is the least context an instance placed without one gets (its trained
#: context when that is shorter); it gets more where memory allows (see
#: :func:`default_context`).
KV_TOKENS = 4096
KV_SEQUENCES = 8
#: Most seats an instance may ask for (``InstanceSpec.seats``): llama.cpp holds at
#: most 256 sequences, and each seat's KV is reserved whole.
MAX_SEATS = 64


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    """The knobs of placement. Every node must use the same values.

    - ``weight_overhead`` (1.2): factor on a stage's layer bytes for what loading and
      running them costs beyond the file bytes (compute buffers, dequantised copies).
    - ``kv_tokens`` (:data:`KV_TOKENS`) and ``kv_sequences`` (:data:`KV_SEQUENCES`):
      KV cache reserved per stage for
      ``kv_sequences`` concurrent requests of ``min(kv_tokens, n_ctx_train)`` tokens
      each, at ``facts.kv_bytes_per_token_layer`` per layer of the stage.
    - ``context_share`` (1/2): an instance placed without a context gets the longest
      one (its trained context, halved until it fits) whose KV reservation is at most
      this share of the memory its plan's nodes offer (see :func:`default_context`),
      so a long default context never takes the room of the next model.
    - ``floor_bytes`` (512 MiB): memory kept free on every node.
    - ``vram_floor_bytes`` (512 MiB): memory kept free on every dedicated GPU (the
      engine's own context and compute buffers live there).
    - ``engine_preference``: backends ranked fastest first
      (:data:`DEFAULT_ENGINE_PREFERENCE`); a backend not listed ranks after them, by
      name.
    - ``credit_held`` (True): with ``previous`` given, a node that has a stage in the
      previous plan and reports a runner for that instance (``NodeResources.holds``
      contains ``previous.id``) gets that stage's footprint (its need less the floor,
      capped at ``mem_total - mem_available`` when ``mem_total`` is known) added to
      its budget: its heartbeat no longer counts that memory as available, and a
      plan must not evict itself.
    """

    weight_overhead: float = 1.2
    kv_tokens: int = KV_TOKENS
    kv_cache: str = "f16"
    kv_sequences: int = KV_SEQUENCES
    context_share: float = 0.5
    floor_bytes: int = 512 * MiB
    vram_floor_bytes: int = 512 * MiB
    engine_preference: tuple[str, ...] = DEFAULT_ENGINE_PREFERENCE
    credit_held: bool = True


def node_vram(r: NodeResources, engine: str, policy: Policy = Policy()) -> int:  # noqa: B008
    """Bytes of dedicated GPU memory a stage of ``engine`` on node ``r`` may use: the
    free memory of the devices of the node's best backend for it (a CPU backend has
    none), less ``policy.vram_floor_bytes`` each. Only llama.cpp stages offload."""
    if engine_of(engine) != "llama_cpp" or not r.devices:
        return 0
    backends = [b for b in r.backends if engine_of(b) == "llama_cpp"]
    if not backends:
        return 0
    best = min(backends, key=lambda b: backend_rank(b, policy.engine_preference))
    return sum(
        max(0, d.mem_free - policy.vram_floor_bytes)
        for d in r.devices
        if d.backend == best and not d.unified
    )


def instance_context(inst: Instance) -> int:
    """Tokens of context each request of ``inst`` gets: what placement chose for it
    (``Instance.context``), else (a record from before it was kept) its spec's, else
    :func:`base_context`."""
    return inst.context or inst.spec.context or base_context(inst.facts)


def with_context(policy: Policy, context: int, kv_cache: str = "", seats: int = 0) -> Policy:
    """``policy`` for an instance's ``context``, ``kv_cache`` and ``seats`` (0 / "":
    the policy's own)."""
    if context:
        policy = msgspec.structs.replace(policy, kv_tokens=context)
    if seats:
        policy = msgspec.structs.replace(policy, kv_sequences=seats)
    if kv_cache:
        policy = msgspec.structs.replace(policy, kv_cache=kv_cache)
    return policy


def instance_seats(inst: Instance) -> int:
    """Requests each runner of ``inst`` holds KV for: its spec's seats, else
    :data:`KV_SEQUENCES`."""
    return inst.spec.seats or KV_SEQUENCES


def base_context(facts: ModelFacts | None) -> int:
    """The least context an instance placed without one gets: :data:`KV_TOKENS`, or
    the model's trained context when that is shorter."""
    if facts is not None and facts.n_ctx_train > 0:
        return min(KV_TOKENS, facts.n_ctx_train)
    return KV_TOKENS


def plan_digest(stages: Iterable[Stage]) -> str:
    """A short stable hash of a plan (16 hex chars): equal plans, equal digests."""
    raw = msgspec.msgpack.encode([[s.node, s.start, s.end, s.engine] for s in stages])
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def next_generation(previous: Instance | None) -> int:
    """Generation of a plan that replaces ``previous`` (1 for a first plan)."""
    return 1 if previous is None else previous.generation + 1

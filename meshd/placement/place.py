"""``place()``: a model's layers -> contiguous stages on live nodes. Pure and deterministic.

Every node runs this same function on the same inputs (the instance spec, the model's
facts, the live nodes' resources, the previous plan) and gets the same plan, with no
coordination round. Nothing here reads a clock, draws a random number, does I/O or
depends on the iteration order of a mapping: candidates are ranked by usable memory
and ties break on node id; shares are exact fractions.

Memory a stage needs on its node (see :func:`stage_need`)::

    ceil(layer bytes x weight_overhead)
    + token embedding   (every llama.cpp stage, the first with the image projector; an
                         MLX stage only when first, or last with a tied output head)
    + head bytes        (last stage)
    + KV reservation    (min(kv_tokens, n_ctx_train) x kv_sequences
                         x kv_bytes_per_token_layer x layers of the stage)
    + floor_bytes       (kept free on the node)

and it must be at most the node's budget: ``mem_available`` (plus, in a repair, the
memory the node already holds for this instance's previous stage, see ``Policy``).

**GPUs.** A llama.cpp stage on a node whose llama.cpp backend has dedicated GPUs
(``NodeResources.devices``) offloads its layers there, the last ones first as
llama.cpp does, each with its KV, as many as fit in the devices' free memory less
``vram_floor_bytes`` each, and the output head too once every layer is there. What is
offloaded leaves the host's need: the stage fits when the rest fits ``mem_available``
(:func:`stage_offload` gives the layer count its runner passes as ``n_gpu_layers``).
Unified memory (Apple silicon, integrated GPUs) is the host's, budgeted as RAM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple

from meshd.crdt.views import Instance, InstanceSpec, Stage
from meshd.domain.facts import ModelFacts

from .errors import PlacementError, fmt_bytes
from .policy import (
    KV_CACHE_TYPES,
    MAX_SEATS,
    Policy,
    base_context,
    node_vram,
    with_context,
)
from .predict import prompt_bytes, request_s, stage_reads
from .resources import NodeResources
from .support import (
    cut_period,
    engine_of,
    model_engines,
    node_engines,
    refused_text,
    stage_holds_states,
    stage_limit,
)


def stage_need(
    facts: ModelFacts,
    start: int,
    end: int,
    engine: str,
    policy: Policy | None = None,
    context: int = 0,
    kv_cache: str = "",
) -> int:
    """Bytes a stage running layers ``[start, end)`` of ``facts`` on ``engine`` needs,
    with ``context`` tokens per request (0: the policy's) in a ``kv_cache`` cache
    ("": the policy's)."""
    return stage_offload(facts, start, end, engine, 0, policy, context, kv_cache).host_need


class Offload(NamedTuple):
    """A stage on a node's dedicated GPUs (:func:`stage_offload`)."""

    #: llama.cpp's ``n_gpu_layers``: the stage's last layers, one more for the output
    #: head (``end - start + 1``: all of it); 0 keeps the stage on the CPU.
    layers: int
    #: Bytes they take on the GPUs.
    gpu_bytes: int
    #: What the stage still takes of the host's memory (:func:`stage_need` less what
    #: left it; a tied head's GPU copy leaves the embedding on the host too).
    host_need: int


def stage_offload(
    facts: ModelFacts,
    start: int,
    end: int,
    engine: str,
    vram: int,
    policy: Policy | None = None,
    context: int = 0,
    kv_cache: str = "",
    seats: int = 0,
) -> Offload:
    """How a stage running layers ``[start, end)`` of ``facts`` on ``engine`` uses
    ``vram`` bytes of dedicated GPU memory (see the module's **GPUs**), with ``context``
    tokens per request in a ``kv_cache`` cache for ``seats`` requests ("" / 0: the
    policy's)."""
    m = _Model.of(facts, with_context(policy or Policy(), context, kv_cache, seats))
    eng = engine_of(engine)
    layers, gpu, host = m.offload(start, end, eng, vram)
    return Offload(layers, gpu, m.need(start, end, eng) - host)


def default_context(
    spec: InstanceSpec,
    facts: ModelFacts,
    nodes: Mapping[str, NodeResources],
    stages: Sequence[Stage],
    previous: Instance | None = None,
    policy: Policy = Policy(),  # noqa: B008 (frozen, immutable)
) -> int:
    """The context of an instance placed as ``stages`` on ``nodes``: ``spec.context``
    when the user set one; else the model's trained context, halved until it fits, and
    never less than :func:`base_context` (the one the stages were placed with).

    A context fits when every stage still fits its node's budget (with a repair's
    credit, taken at that context) and the plan's whole KV reservation is at most
    ``policy.context_share`` of the usable memory of the plan's nodes. The plan is
    not changed for a longer context: it only takes memory its nodes have spare.
    Pure, like :func:`place`: every node chooses the same context.
    """
    if spec.context:
        return spec.context
    base = base_context(facts)
    if facts.n_ctx_train <= base or not stages:
        return base
    res = _by_id(nodes)
    prev = _previous_stages(previous, facts.n_layers)
    used = sorted({s.node for s in stages})
    if any(n not in res for n in used):
        return base
    tokens = facts.n_ctx_train
    while tokens > base:
        m = _Model.of(facts, with_context(policy, tokens, spec.kv_cache, spec.seats))
        credit: Mapping[str, int] = {}
        if prev is not None and previous is not None and policy.credit_held:
            credit = _credits(previous.id, prev, m, res, policy)
        budget = {n: res[n].mem_available + credit.get(n, 0) for n in used}
        kv = sum(m.kv(engine_of(s.engine)) * (s.end - s.start) for s in stages)
        vram = {s.node: node_vram(res[s.node], engine_of(s.engine), policy) for s in stages}
        usable = sum(max(0, budget[n] - m.floor) for n in used) + sum(vram.values())
        if kv <= usable * policy.context_share and all(
            m.host_need(s.start, s.end, engine_of(s.engine), vram[s.node]) <= budget[s.node]
            for s in stages
        ):
            return tokens
        tokens //= 2
    return base


def place_fetching(
    spec: InstanceSpec,
    facts: ModelFacts,
    holders: Mapping[str, NodeResources],
    fetchers: Mapping[str, NodeResources],
    previous: Instance | None = None,
    policy: Policy = Policy(),  # noqa: B008 (frozen, immutable)
) -> tuple[list[Stage], dict[str, NodeResources]]:
    """:func:`place` on the nodes that hold the model's file first, and only when no
    plan fits there (too little memory, a pinned node that lacks the file) on
    ``fetchers`` too: nodes that would fetch their stage's slice from a holder.

    A repair counts the fetchers of ``previous`` as holders (they fetched their slice
    already), so a plan does not move a stage off a node only because it lacked the
    file. Returns the stages and the nodes of the pass that placed them; raises the
    wider pass's :class:`PlacementError` when neither fits.
    """
    first = dict(holders)
    if previous is not None:
        kept = {s.node for s in previous.stages}
        first.update({k: v for k, v in fetchers.items() if k in kept})
    try:
        return place(spec, facts, first, previous, policy), first
    except PlacementError:
        wider = {**fetchers, **first}
        if len(wider) == len(first):
            raise
    return place(spec, facts, wider, previous, policy), wider


def placement(
    spec: InstanceSpec,
    facts: ModelFacts,
    holders: Mapping[str, NodeResources],
    fetchers: Mapping[str, NodeResources],
    previous: Instance | None = None,
    policy: Policy = Policy(),  # noqa: B008 (frozen, immutable)
) -> Placement:
    """:func:`place_fetching`, and the context the plan serves (:func:`default_context`)."""
    stages, nodes = place_fetching(spec, facts, holders, fetchers, previous, policy)
    context = default_context(spec, facts, nodes, stages, previous, policy)
    return Placement(stages, nodes, context)


class Placement(NamedTuple):
    """A plan (:func:`placement`): its stages, the nodes it was chosen among and the
    context (tokens per request) its runners allocate."""

    stages: list[Stage]
    nodes: dict[str, NodeResources]
    context: int


def repair_needed(instance: Instance, live_ids: Iterable[str]) -> bool:
    """True when a stage's node is not live, or the plan is empty or broken."""
    live = set(live_ids)
    if not instance.stages or any(s.node not in live for s in instance.stages):
        return True
    n = instance.facts.n_layers if instance.facts is not None else instance.stages[-1].end
    return not _covers(instance.stages, n)


def place(
    spec: InstanceSpec,
    facts: ModelFacts,
    nodes: Mapping[str, NodeResources],
    previous: Instance | None = None,
    policy: Policy = Policy(),  # noqa: B008 (frozen, immutable)
) -> list[Stage]:
    """Stages ``(node, start, end, engine)`` covering ``[0, facts.n_layers)`` in order.

    Raises :class:`PlacementError` when no plan fits.

    **Engine.** A node can run the engines that can build the model (``facts.engines``
    that the architecture rule allows: :func:`~meshd.placement.support.model_engines`)
    for which it has a backend ``<engine>-<device>``; it uses the one of its
    best-ranked backend (``policy.engine_preference``). ``spec.engines`` pins it, per
    stage, parallel to ``spec.nodes`` (an empty entry leaves that stage free); with no
    ``spec.nodes``, one entry pins every stage. A node with no usable engine is never
    chosen; the error names the engines that cannot build the model, and why.

    **Splits.** Only a proven split is cut, some every few layers, boundaries moved there
    (``support.stage_limit``); asked for more, or fitting no fewer nodes, the error says why.

    **Fresh plan.** Candidates are ranked by usable memory (budget less the floor), most first,
    ties on node id. For k = ``spec.min_nodes``, k + 1, ..., the top k candidates, in rank
    order, get the layers split in proportion to usable memory (in proportion to measured speed,
    ``decode_bps``, instead when every one of them has one), rounded by largest remainder (ties
    to the earlier stage), every stage >= 1 layer; then each boundary, left to right, is moved
    to the nearest position (ties: the lower one) for which this stage fits its node and the
    stages after it can still fit theirs. The first k that fits wins: one node when the model
    fits on one. When every candidate has measured its speed, each k that fits is tried and a
    plan on more nodes replaces one on fewer only when a request through it is predicted
    :data:`SPLIT_GAIN` times sooner (``predict.request_s``: the prompt's rows, the answer).

    **Nodes.** Those in ``spec.exclude`` (ids) are left out first. ``spec.nodes`` (ids
    or names, in stage order) pin: split as above; one not live raises ``unknown_node``.

    **Repair (``previous`` given).** ``previous.stages`` is ignored when it does not
    cover ``[0, n_layers)`` contiguously with distinct nodes. Otherwise a previous
    stage *survives* when its node is live, still runs its engine for this model, and
    the stage fits its budget (with the credit of ``Policy.credit_held``).

    1. Every stage survives and there are at least ``min_nodes`` of them: the previous
       stages are returned unchanged (a join never moves a model).
    2. Otherwise consecutive non-surviving stages form gaps. Gaps are filled left to
       right; each takes its cheapest feasible option, cost compared as (stages that
       must (re)load, layers they (re)load; a stage whose range changes reloads all of
       its layers), then in this order:

       - *new*: the gap, unchanged, on the best-ranked node not in the plan that fits
         it, else split over the fewest such nodes (top-ranked first, as above);
       - *left*: the surviving stage before the gap extends its end over it;
       - *right*: the surviving stage after the gap extends its start over it;
       - *both*: the two neighbours share it (boundary nearest the split in
         proportion to their usable memory, ties lower).

       Surviving stages keep their node, order and engine, and their range except for
       the extension they take on. A node of the previous plan whose stage did not
       survive is not reused by the repair.
    3. If a gap has no feasible option, or the result has fewer than ``min_nodes``
       stages, the plan is made fresh (budgets still credited), as if no previous.

    With ``spec.nodes``, the previous stages are returned unchanged when they are on
    exactly those nodes (and pinned engines) and still fit; otherwise a fresh pinned
    plan is made.
    """
    # The stages are placed with the base context; default_context then lengthens it
    # within the memory they leave (never moving a stage for it).
    if spec.context < 0 or (facts.n_ctx_train > 0 and spec.context > facts.n_ctx_train):
        raise PlacementError(
            "bad_spec",
            f"context {spec.context} is outside what model {facts.name!r} was trained for "
            f"(1 to {facts.n_ctx_train} tokens)",
        )
    if spec.kv_cache not in KV_CACHE_TYPES:
        raise PlacementError(
            "bad_spec",
            f"kv_cache {spec.kv_cache!r} is none of {', '.join(KV_CACHE_TYPES)}",
        )
    policy = with_context(policy, spec.context, spec.kv_cache, spec.seats)
    m = _Model.of(facts, policy)
    res = {k: v for k, v in _by_id(nodes).items() if k not in spec.exclude}
    _check_spec(spec, m)
    prev = _previous_stages(previous, m.n)
    credit = {}
    if prev is not None and previous is not None and policy.credit_held:
        credit = _credits(previous.id, prev, m, res, policy)

    if spec.nodes:
        return _place_pinned(spec, m, res, credit, prev, policy)

    pin = _single_engine_pin(spec, m)
    allowed = m.engines if pin is None else (pin,)
    if not res:
        raise PlacementError("no_nodes", f"no live node to place model {m.name!r} on")
    if len(res) < spec.min_nodes:
        raise PlacementError(
            "no_nodes",
            f"model {m.name!r} asks for at least {spec.min_nodes} nodes "
            f"but only {len(res)} are live",
        )
    cands = {
        nid: c
        for nid in sorted(res)
        if (c := _candidate(res[nid], allowed, m, credit, policy)) is not None
    }
    if len(cands) < spec.min_nodes or not cands:
        raise PlacementError(
            "no_backend",
            f"model {m.name!r} needs a node with a backend for {' or '.join(allowed)}; "
            f"{len(cands)} of {len(res)} live node(s) have one"
            + (f", {spec.min_nodes} needed" if spec.min_nodes > 1 else "")
            + refused_text(m.refused, (b for r in res.values() for b in r.backends)),
        )
    ranked = sorted(cands.values(), key=lambda c: (-c.usable, c.id))

    if prev is not None:
        alive = [_survives(s, cands, m) for s in prev]
        if all(alive) and len(prev) >= spec.min_nodes:
            return list(prev)
        repaired = _repair(m, prev, alive, cands, ranked, spec.min_nodes)
        if repaired is not None and len(repaired) <= m.max_stages:
            return repaired
    return _place_fresh(m, ranked, spec, facts)


def _check_spec(spec: InstanceSpec, m: _Model) -> None:
    """Raise for what no node changes: a spec the model cannot have, no engine to run it."""
    if spec.min_nodes < 1:
        raise PlacementError("bad_spec", f"min_nodes must be >= 1, not {spec.min_nodes}")
    if spec.seats > MAX_SEATS:  # fewer than none: _Model.of refuses
        raise PlacementError("bad_spec", f"seats {spec.seats} is over {MAX_SEATS}")
    if spec.min_nodes > m.n:
        raise PlacementError(
            "bad_spec",
            f"min_nodes={spec.min_nodes} but model {m.name!r} has only {m.n} layer(s)",
        )
    if max(spec.min_nodes, len(spec.nodes)) > m.max_stages:
        raise PlacementError("bad_spec", f"model {m.name!r} ({m.arch}) {m.unsplit}")
    if not m.engines:
        raise PlacementError("no_backend", f"no engine can build model {m.name!r}{m.refused_all}")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class _Model:
    name: str
    n: int
    prefix: tuple[int, ...]  # prefix[i] = bytes of layers [0, i)
    # ... of them a decoded token reads (a MoE block runs some of its experts).
    active: tuple[int, ...]
    embed: int
    head: int
    projector: int  # image projector bytes, on a llama.cpp stage 0
    kv_layer: int  # KV reservation per layer (F16, as MLX keeps it)
    kv_tokens: int  # ... for this many tokens a request
    kv_sequences: int  # ... and this many requests
    overhead: float
    floor: int
    engines: tuple[str, ...]
    preference: tuple[str, ...]
    #: Most stages the model may be cut into, and why no more ("" when a stage may start
    #: at any layer; see support.stage_limit); each starts at a multiple of ``period``.
    max_stages: int
    arch: str
    unsplit: str = ""
    period: int = 1
    refused: tuple[tuple[str, str], ...] = ()
    #: Bytes of a llama.cpp stage's KV element relative to F16 (its cache type).
    kv_factor: float = 1.0
    kv_cache: str = "f16"
    #: Each layer's kind of state (``ModelFacts.layer_state``; "": attention only).
    state: str = ""

    @staticmethod
    def of(facts: ModelFacts, policy: Policy) -> _Model:
        name = facts.name
        if facts.n_layers < 1:
            raise PlacementError("bad_spec", f"model {name!r} has n_layers={facts.n_layers}")
        if len(facts.layer_bytes) != facts.n_layers:
            raise PlacementError(
                "bad_spec",
                f"model {name!r} has n_layers={facts.n_layers} "
                f"but {len(facts.layer_bytes)} layer sizes",
            )
        sizes = [*facts.layer_bytes, facts.embed_bytes, facts.head_bytes]
        if min(sizes) < 0 or facts.kv_bytes_per_token_layer < 0:
            raise PlacementError("bad_spec", f"model {name!r} has a negative size")
        if not (policy.weight_overhead > 0 and math.isfinite(policy.weight_overhead)):
            raise PlacementError("bad_spec", f"bad weight_overhead {policy.weight_overhead}")
        if policy.kv_tokens < 0 or policy.kv_sequences < 0 or policy.floor_bytes < 0:
            raise PlacementError("bad_spec", "policy sizes must be >= 0")
        prefix = [0]
        for b in facts.layer_bytes:
            prefix.append(prefix[-1] + b)
        active = [0]
        for b in facts.active_layer_bytes():
            active.append(active[-1] + b)
        tokens = policy.kv_tokens
        if facts.n_ctx_train > 0:
            tokens = min(tokens, facts.n_ctx_train)
        engines, refused = model_engines(facts, policy.kv_cache)
        max_stages, unsplit = stage_limit(facts)
        return _Model(
            name=name,
            n=facts.n_layers,
            prefix=tuple(prefix),
            active=tuple(active),
            embed=facts.embed_bytes,
            head=facts.head_bytes,
            projector=facts.projector_bytes,
            kv_layer=tokens * policy.kv_sequences * facts.kv_bytes_per_token_layer,
            kv_tokens=tokens,
            kv_sequences=policy.kv_sequences,
            overhead=policy.weight_overhead,
            floor=policy.floor_bytes,
            engines=engines,
            preference=tuple(policy.engine_preference),
            max_stages=max_stages,
            arch=facts.architecture,
            unsplit=unsplit,
            period=cut_period(facts),
            refused=refused,
            kv_factor=KV_CACHE_TYPES.get(policy.kv_cache, 1.0),
            kv_cache=policy.kv_cache,
            state=facts.layer_state if len(facts.layer_state) == facts.n_layers else "",
        )

    @property
    def refused_all(self) -> str:
        """``": llama_cpp cannot ...; mlx cannot ..."``: every engine refused, and why."""
        return ": " + "; ".join(f"{e} cannot: {why}" for e, why in self.refused)

    def need(self, start: int, end: int, engine: str) -> int:
        first, last = start == 0, end == self.n
        extra = (self.head if last else 0) + (self.projector if first and engine != "mlx" else 0)
        # llama.cpp demands token_embd in every slice; MLX embeds on the first stage
        # and uses the embedding as the output head on the last one when it is tied.
        if engine != "mlx" or first or (last and self.head == 0):
            extra += self.embed
        weights = math.ceil((self.prefix[end] - self.prefix[start]) * self.overhead)
        return weights + extra + self.kv(engine) * (end - start) + self.floor

    def kv(self, engine: str) -> int:
        """KV bytes a layer reserves on ``engine`` (llama.cpp keeps the cache type)."""
        return self.kv_layer if engine == "mlx" else math.ceil(self.kv_layer * self.kv_factor)

    def offload(self, start: int, end: int, engine: str, vram: int) -> tuple[int, int, int]:
        """``(n_gpu_layers, bytes on the GPU, bytes that leave the host)`` of a stage
        with ``vram`` bytes of dedicated GPU memory. llama.cpp offloads the last layers
        first, each with its KV; with every layer there, the output head follows when
        it fits (a tied head is a copy of the embedding, which the host keeps too)."""
        if vram <= 0 or engine != "llama_cpp":
            return 0, 0, 0
        kv = self.kv(engine)
        used = k = 0
        for i in range(end - 1, start - 1, -1):
            b = math.ceil((self.prefix[i + 1] - self.prefix[i]) * self.overhead) + kv
            if used + b > vram:
                return k, used, used
            used, k = used + b, k + 1
        if end == self.n:
            head = self.head or self.embed
            if used + head <= vram:
                return k + 1, used + head, used + self.head
        return k, used, used

    def host_need(self, start: int, end: int, engine: str, vram: int = 0) -> int:
        """:meth:`need` less what goes on ``vram`` bytes of dedicated GPU memory."""
        return self.need(start, end, engine) - self.offload(start, end, engine, vram)[2]

    def holds(self, start: int, end: int) -> bool:
        """Whether a stage of layers ``[start, end)`` starts where the model may be cut
        and holds each kind of state it keeps (see :mod:`~meshd.placement.support`)."""
        return start % self.period == 0 and stage_holds_states(self.state, start, end)

    def min_end(self, start: int) -> int:
        """The least end of a stage from ``start`` that :meth:`holds` (n + 1: none)."""
        return next((e for e in range(start + 1, self.n + 1) if self.holds(start, e)), self.n + 1)

    def fits(self, start: int, end: int, engine: str, c: _Cand) -> bool:
        """Whether the stage fits candidate ``c``: its host part in ``c.budget``."""
        return self.host_need(start, end, engine, c.gpu(engine)) <= c.budget


# ------------------------------------------------------------------------ candidates


@dataclass(frozen=True)
class _Cand:
    id: str
    name: str
    engines: tuple[str, ...]  # engines usable here, best first
    budget: int  # mem_available (+ credit)
    usable: int  # budget - floor
    speed: float  # decode_bps, 0: not measured
    #: Usable dedicated GPU bytes per engine (node_vram), for those that have any.
    vram: tuple[tuple[str, int], ...] = ()
    rtt: Mapping[str, float] = field(default_factory=dict)
    bw: Mapping[str, float] = field(default_factory=dict)  # Mbit/s, absent: unknown

    @property
    def engine(self) -> str:
        return self.engines[0]

    def gpu(self, engine: str) -> int:
        return next((v for e, v in self.vram if e == engine), 0)


def _by_id(nodes: Mapping[str, NodeResources]) -> dict[str, NodeResources]:
    out: dict[str, NodeResources] = {}
    for key in sorted(nodes):
        r = nodes[key]
        if r.id != key:
            raise PlacementError("bad_spec", f"node resources keyed {key!r} carry id {r.id!r}")
        out[key] = r
    return out


def _candidate(
    r: NodeResources,
    allowed: Sequence[str],
    m: _Model,
    credit: Mapping[str, int],
    policy: Policy,
) -> _Cand | None:
    engines = node_engines(r.backends, allowed, m.preference)
    if not engines:
        return None
    budget = r.mem_available + credit.get(r.id, 0)
    speed = r.decode_bps if math.isfinite(r.decode_bps) and r.decode_bps > 0 else 0.0
    vram = tuple((e, v) for e in engines if (v := node_vram(r, e, policy)) > 0)
    # A GPU's memory is room too: it ranks the node like RAM would.
    usable = budget - m.floor + sum(v for _, v in vram[:1])
    return _Cand(r.id, r.name, tuple(engines), budget, usable, speed, vram, r.rtt_ms, r.bw_mbps)


def _label(c: _Cand) -> str:
    return f"node {c.name!r} ({c.id[:8]})" if c.name else f"node {c.id!r}"


def _room(c: _Cand, engine: str) -> str:
    """What a candidate offers a stage, for an error: RAM, and GPU memory if any."""
    gpu = c.gpu(engine)
    ram = fmt_bytes(max(0, c.usable - sum(v for _, v in c.vram[:1])))
    return f"{ram} usable" + (f" + {fmt_bytes(gpu)} of GPU memory" if gpu else "")


# --------------------------------------------------------------------------- predict

#: A plan on more nodes must predict its request this many times sooner than one on fewer.
SPLIT_GAIN = 1.05


# ----------------------------------------------------------------------------- split


def _shares(members: Sequence[_Cand]) -> list[Fraction]:
    k = len(members)
    usable = [max(0, c.usable) for c in members]
    total = sum(usable)
    shares = [Fraction(u, total) if total else Fraction(1, k) for u in usable]
    if k > 1 and all(c.speed > 0 for c in members):
        # Measured: layers in proportion to speed (memory bounds them in _split).
        speeds = [Fraction(c.speed) for c in members]
        fast = sum(speeds)
        shares = [v / fast for v in speeds]
    return shares


def _targets(lo: int, hi: int, members: Sequence[_Cand]) -> list[int]:
    """Proportional boundaries over ``[lo, hi)``, largest remainder, >= 1 layer each."""
    n, k = hi - lo, len(members)
    quotas = [n * s for s in _shares(members)]
    counts = [math.floor(q) for q in quotas]
    for i in sorted(range(k), key=lambda i: (counts[i] - quotas[i], i))[: n - sum(counts)]:
        counts[i] += 1
    while 0 in counts:
        donor = min(range(k), key=lambda i: (-counts[i], i))
        counts[donor] -= 1
        counts[counts.index(0)] += 1
    bounds = [lo]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


def _split(
    m: _Model, lo: int, hi: int, members: Sequence[_Cand], engines: Sequence[str]
) -> list[Stage] | None:
    """Layers ``[lo, hi)`` over ``members`` in this order, each within budget, or None."""
    k = len(members)
    if k == 0 or hi - lo < k:
        return None
    target = _targets(lo, hi, members)

    def maxend(i: int, s: int) -> int:
        """Largest end for stage i starting at s that fits (s if none)."""
        c, eng = members[i], engines[i]
        if i == k - 1:
            return hi if m.fits(s, hi, eng, c) else s
        a, b = s, hi - (k - 1 - i)
        while a < b:
            mid = (a + b + 1) // 2
            if m.fits(s, mid, eng, c):
                a = mid
            else:
                b = mid - 1
        return a

    # ok[i][s]: stages i..k-1 can cover [s, hi).
    ok = [[False] * (hi + 2) for _ in range(k + 1)]
    ok[k][hi] = True
    for i in range(k - 1, -1, -1):
        nxt = [hi + 1] * (hi + 2)  # nxt[e]: smallest e' >= e with ok[i+1][e']
        for e in range(hi, lo - 1, -1):
            nxt[e] = e if ok[i + 1][e] else nxt[e + 1]
        first_s = lo if i == 0 else lo + i
        last_s = lo if i == 0 else hi - (k - i)
        for s in range(first_s, last_s + 1):
            me = maxend(i, s)
            # The stage must also hold every kind of state the model keeps (a hybrid).
            ok[i][s] = me > s and nxt[min(max(s + 1, m.min_end(s)), hi + 1)] <= me
    if not ok[0][lo]:
        return None
    bounds = [lo]
    for i in range(k - 1):
        s = bounds[-1]
        feasible = [e for e in range(max(s + 1, m.min_end(s)), maxend(i, s) + 1) if ok[i + 1][e]]
        bounds.append(min(feasible, key=lambda e: (abs(e - target[i + 1]), e)))
    bounds.append(hi)
    return [
        Stage(node=c.id, start=bounds[i], end=bounds[i + 1], engine=engines[i])
        for i, c in enumerate(members)
    ]


_MAX_LISTED = 6  # nodes named in an error message (``shortfalls`` has them all)


def _insufficient(m: _Model, members: Sequence[_Cand], engines: Sequence[str]) -> PlacementError:
    """The error for ``members`` not holding the model: shortfalls of the target split."""
    bounds = _targets(0, m.n, members)
    shortfalls: dict[str, int] = {}
    parts: list[str] = []
    total_need = 0
    for i, c in enumerate(members):
        a, b = bounds[i], bounds[i + 1]
        need = m.need(a, b, engines[i])
        total_need += need - m.floor
        short = m.host_need(a, b, engines[i], c.gpu(engines[i])) - c.budget
        if short > 0:
            shortfalls[c.id] = short
            layers = f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}"
            parts.append(
                f"{_label(c)} needs {fmt_bytes(need - m.floor)} for {layers} "
                f"but has {_room(c, engines[i])}: {fmt_bytes(short)} short"
            )
    if not parts:  # cannot happen (a fitting target split would have been found)
        c = members[0]
        shortfalls[c.id] = 1
        parts.append(f"{_label(c)} cannot take its share")
    if len(parts) > _MAX_LISTED:
        parts[_MAX_LISTED:] = [f"and {len(parts) - _MAX_LISTED} more node(s) short"]
    usable = sum(max(0, c.usable) for c in members)
    where = f"{len(members)} node{'s' if len(members) > 1 else ''}"
    per_layer = m.kv("llama_cpp")
    kv = (
        f"; of that, KV for {m.kv_tokens} tokens x {m.kv_sequences} requests is "
        f"{fmt_bytes(per_layer)} a layer ({m.kv_cache} on llama.cpp), "
        f"{fmt_bytes(per_layer * m.n)} in all "
        "(a smaller context needs less, as does kv_cache q8_0 or q4_0)"
        if m.kv_layer
        else ""
    )
    return PlacementError(
        "insufficient_memory",
        f"model {m.name!r} does not fit on {where} ({fmt_bytes(total_need)} needed, "
        f"{fmt_bytes(usable)} usable): " + "; ".join(parts) + kv,
        shortfalls,
    )


def _place_fresh(
    m: _Model, ranked: Sequence[_Cand], spec: InstanceSpec, facts: ModelFacts
) -> list[Stage]:
    min_nodes = spec.min_nodes
    # A request is priced with a prompt of the context's rows at its hops' dtype.
    prompt = prompt_bytes(facts, m.kv_tokens, "f32" if spec.exact else spec.activations)
    top = min(len(ranked), m.n, m.max_stages)
    # A plan needs at least every layer, the embedding and head once, a floor per node.
    least = m.n * min(m.kv(e) for e in m.engines) + m.embed + m.head
    least += math.floor(m.prefix[-1] * m.overhead) - m.n  # - n: float rounding, stay low
    budgets = 0
    best: tuple[float, list[Stage]] | None = None
    measured = all(c.speed > 0 for c in ranked)
    for k in range(1, top + 1):
        budgets += ranked[k - 1].usable
        if k < min_nodes or least > budgets:
            continue
        members = ranked[:k]
        plan = _split(m, 0, m.n, members, [c.engine for c in members])
        if plan is None:
            continue
        if not measured:
            return plan  # the fewest nodes that fit
        # Every node measured: a split that fits with fewer nodes is taken only when a
        # request through it (the prompt's rows over its links, then the answer)
        # predicts SPLIT_GAIN times sooner (hops cost on a real LAN).
        secs = request_s(stage_reads(facts, plan), members, prompt)  # stages in members' order
        if best is None or secs * SPLIT_GAIN < best[0]:
            best = (secs, plan)
    if best is not None:
        return best[1]
    members = ranked[: max(min_nodes, top)]
    err = _insufficient(m, members, [c.engine for c in members])
    if m.unsplit and len(ranked) > m.max_stages:
        err = PlacementError(err.reason, f"{err.message} ({m.arch} {m.unsplit})", err.shortfalls)
    raise err


# ---------------------------------------------------------------------------- pinned


def _single_engine_pin(spec: InstanceSpec, m: _Model) -> str | None:
    pins = [engine_of(e) for e in spec.engines if e]
    if len(spec.engines) > 1:
        raise PlacementError(
            "bad_spec", "spec.engines lists engines per stage: it needs spec.nodes beside it"
        )
    if not pins:
        return None
    if pins[0] not in m.engines:
        raise _not_on(m, pins[0])
    return pins[0]


def _not_on(m: _Model, engine: str) -> PlacementError:
    """The error for a pin to an engine the model does not run on, with why."""
    why = dict(m.refused).get(engine)
    return PlacementError(
        "bad_spec",
        f"model {m.name!r} runs on {', '.join(m.engines) or 'no engine'}, not on {engine!r}"
        + (f": {why}" if why else ""),
    )


def _resolve(refs: Sequence[str], res: Mapping[str, NodeResources]) -> list[str]:
    by_name: dict[str, list[str]] = {}
    for nid in sorted(res):
        by_name.setdefault(res[nid].name, []).append(nid)
    ids: list[str] = []
    for ref in refs:
        if ref in res:
            ids.append(ref)
        elif len(by_name.get(ref, [])) == 1:
            ids.append(by_name[ref][0])
        elif ref in by_name:
            raise PlacementError(
                "bad_spec", f"node name {ref!r} is ambiguous: ids {', '.join(by_name[ref])}"
            )
        else:
            live = ", ".join(sorted(f"{r.name or '?'} ({nid[:8]})" for nid, r in res.items()))
            raise PlacementError(
                "unknown_node",
                f"spec names node {ref!r}, which is not a live node (live: {live or 'none'})",
            )
    if len(set(ids)) != len(ids):
        raise PlacementError("bad_spec", "spec.nodes lists the same node twice")
    return ids


def _place_pinned(
    spec: InstanceSpec,
    m: _Model,
    res: Mapping[str, NodeResources],
    credit: Mapping[str, int],
    prev: tuple[Stage, ...] | None,
    policy: Policy,
) -> list[Stage]:
    if spec.engines and len(spec.engines) != len(spec.nodes):
        raise PlacementError(
            "bad_spec",
            f"spec.engines has {len(spec.engines)} entries for {len(spec.nodes)} nodes",
        )
    if len(spec.nodes) > m.n:
        raise PlacementError(
            "bad_spec", f"{len(spec.nodes)} nodes for a model of only {m.n} layer(s)"
        )
    if spec.min_nodes > len(spec.nodes):
        raise PlacementError(
            "bad_spec", f"min_nodes={spec.min_nodes} but spec.nodes lists {len(spec.nodes)}"
        )
    ids = _resolve(spec.nodes, res)
    members: list[_Cand] = []
    for i, nid in enumerate(ids):
        pin = engine_of(spec.engines[i]) if spec.engines and spec.engines[i] else None
        if pin is not None and pin not in m.engines:
            raise _not_on(m, pin)
        c = _candidate(res[nid], m.engines if pin is None else (pin,), m, credit, policy)
        if c is None:
            r = res[nid]
            want = pin or " or ".join(m.engines)
            raise PlacementError(
                "no_backend",
                f"node {r.name!r} ({nid[:8]}) has no backend for {want} "
                f"(it has {', '.join(r.backends) or 'none'})"
                + ("" if pin else refused_text(m.refused, r.backends)),
            )
        members.append(c)
    if (
        prev is not None
        and [s.node for s in prev] == ids
        and all(
            s.engine in c.engines
            and m.fits(s.start, s.end, s.engine, c)
            and m.holds(s.start, s.end)
            for s, c in zip(prev, members, strict=True)
        )
    ):
        return list(prev)
    engines = [c.engine for c in members]
    plan = _split(m, 0, m.n, members, engines)
    if plan is None:
        raise _insufficient(m, members, engines)
    return plan


# ---------------------------------------------------------------------------- repair


def _covers(stages: Sequence[Stage], n: int) -> bool:
    pos = 0
    for s in stages:
        if s.start != pos or s.end <= s.start:
            return False
        pos = s.end
    return pos == n


def _previous_stages(previous: Instance | None, n: int) -> tuple[Stage, ...] | None:
    if previous is None:
        return None
    stages = tuple(previous.stages)
    if not _covers(stages, n) or len({s.node for s in stages}) != len(stages):
        return None
    return stages


def _credits(
    instance: str,
    prev: Sequence[Stage],
    m: _Model,
    res: Mapping[str, NodeResources],
    policy: Policy,
) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in prev:
        r = res.get(s.node)
        if r is None or instance not in r.holds:
            continue
        # What it holds of the host's memory (a GPU's share is not in mem_available).
        held = (
            m.host_need(s.start, s.end, engine_of(s.engine), node_vram(r, s.engine, policy))
            - m.floor
        )
        if r.mem_total > 0:
            held = min(held, r.mem_total - r.mem_available)
        out[s.node] = max(0, held)
    return out


def _survives(s: Stage, cands: Mapping[str, _Cand], m: _Model) -> bool:
    c = cands.get(s.node)
    return (
        c is not None
        and s.engine in c.engines
        and m.fits(s.start, s.end, s.engine, c)
        and m.holds(s.start, s.end)
    )


def _fill_new(m: _Model, a: int, b: int, fresh: Sequence[_Cand]) -> list[Stage] | None:
    """The gap ``[a, b)`` on nodes outside the plan: one if one fits, else the fewest."""
    for c in fresh:
        if m.fits(a, b, c.engine, c) and m.holds(a, b):
            return [Stage(node=c.id, start=a, end=b, engine=c.engine)]
    for j in range(2, min(len(fresh), b - a) + 1):
        members = fresh[:j]
        plan = _split(m, a, b, members, [c.engine for c in members])
        if plan is not None:
            return plan
    return None


def _repair(
    m: _Model,
    prev: tuple[Stage, ...],
    alive: list[bool],
    cands: Mapping[str, _Cand],
    ranked: Sequence[_Cand],
    min_nodes: int,
) -> list[Stage] | None:
    if not any(alive):
        return None
    # Segments in order: ("keep", stage index) or ("gap", start, end).
    segs: list[tuple[str, int, int]] = []
    for i, s in enumerate(prev):
        if alive[i]:
            segs.append(("keep", i, 0))
        elif segs and segs[-1][0] == "gap":
            segs[-1] = ("gap", segs[-1][1], s.end)
        else:
            segs.append(("gap", s.start, s.end))
    rng = {i: (prev[i].start, prev[i].end) for i in range(len(prev)) if alive[i]}
    moved: set[int] = set()
    used = {s.node for s in prev}
    fills: dict[int, list[Stage]] = {}

    def fits(i: int, start: int, end: int) -> bool:
        return m.fits(start, end, prev[i].engine, cands[prev[i].node]) and m.holds(start, end)

    for j, (kind, a, b) in enumerate(segs):
        if kind != "gap":
            continue
        left = segs[j - 1][1] if j > 0 else None
        right = segs[j + 1][1] if j + 1 < len(segs) else None
        # (stages reloaded, layers reloaded, option order, option, payload)
        options: list[tuple[int, int, int, str, object]] = []
        new = _fill_new(m, a, b, [c for c in ranked if c.id not in used])
        if new is not None:
            options.append((len(new), b - a, 0, "new", new))
        l_cost = (0, 0)
        if left is not None:
            ls, _ = rng[left]
            l_cost = (0, 0) if left in moved else (1, a - ls)
            if fits(left, ls, b):
                options.append((l_cost[0], l_cost[1] + b - a, 1, "left", None))
        if right is not None:
            _, re_ = rng[right]
            if fits(right, a, re_):
                options.append((1, re_ - a, 2, "right", None))
        if left is not None and right is not None and b - a >= 2:
            ls, re_ = rng[left][0], rng[right][1]
            ul, ur = cands[prev[left].node].usable, cands[prev[right].node].usable
            share = Fraction(max(0, ul), max(0, ul) + max(0, ur)) if ul + ur > 0 else Fraction(1, 2)
            aim = a + (b - a) * share
            xs = [x for x in range(a + 1, b) if fits(left, ls, x) and fits(right, x, re_)]
            if xs:
                x = min(xs, key=lambda x: (abs(x - aim), x))
                options.append((l_cost[0] + 1, l_cost[1] + re_ - a, 3, "both", x))
        if not options:
            return None
        _, _, _, choice, payload = min(options, key=lambda o: o[:3])
        if choice == "new":
            fills[j] = payload  # type: ignore[assignment]  # "new": its stages
            used.update(s.node for s in fills[j])
        if choice in ("left", "both") and left is not None:
            end = b if choice == "left" else payload
            rng[left] = (rng[left][0], end)  # type: ignore[assignment]  # "both": an int
            moved.add(left)
        if choice in ("right", "both") and right is not None:
            start = a if choice == "right" else payload
            rng[right] = (start, rng[right][1])  # type: ignore[assignment]  # "both": an int
            moved.add(right)

    out: list[Stage] = []
    for j, (kind, i, _) in enumerate(segs):
        if kind == "keep":
            start, end = rng[i]
            out.append(Stage(node=prev[i].node, start=start, end=end, engine=prev[i].engine))
        else:
            out.extend(fills.get(j, []))
    if len(out) < min_nodes or not _covers(out, m.n):
        return None
    for s in out:
        if not m.fits(s.start, s.end, s.engine, cands[s.node]) or not m.holds(s.start, s.end):
            return None
    return out

"""What a node says of each placed instance: the body of ``GET /v1/instances`` (and of
``GET /v1/instances/{id}``, ``POST /v1/instances``, and every event of
``GET /v1/instances/stream``).

It is the node's own reading of the cluster, made by the queries the node itself acts
on (:class:`~meshd.node.cluster.ClusterView`: stage states, readiness, which nodes gave
up on an instance, what cannot be repaired, the speeds placement predicts and the API
nodes measured), so a client shows what the node decides by and never re-derives a
rule from the raw heartbeats of ``GET /v1/cluster``. ``meshctl top`` renders it; a web
page can too.

Every field is always present (``null`` where a figure is not known yet), so a
client reads it without guessing what an omission means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from meshd.crdt.views import Instance
from meshd.domain.facts import ModelFacts
from meshd.domain.recurrent import state_refusals
from meshd.node.cluster import ClusterView, InstanceSpeed, StageState, instance_state
from meshd.placement import instance_context, node_resources, predicted_transfer_s
from meshd.placement.support import split_refusal, stage_limit

__all__ = [
    "ExcludedNode",
    "InstanceList",
    "InstanceView",
    "SpeedView",
    "StageView",
    "instance_list",
    "instance_view",
]


class StageView(msgspec.Struct, kw_only=True):
    """One stage of an instance: where it runs, which layers, how its runner is."""

    #: The node that runs it: its id, its name (its id's first 8 characters when it
    #: has no card), and its liveness as the answering node sees it (``alive``,
    #: ``suspect``, ``dead``, ``left``; ``unknown`` before a heartbeat was seen).
    node: str
    name: str
    liveness: str
    #: Its layers, ``[start, end)``, and the engine that runs them.
    start: int
    end: int
    engine: str
    #: Its runner: ``pending`` (not reported yet), ``fetching`` (its slice, from the
    #: nodes that hold the model), ``loading``, ``ready``, ``failed``, ``stopped``, or
    #: ``unavailable`` (its node is not live). A runner ready for another generation
    #: of the plan is ``loading``.
    state: str
    #: Why it is in that state ("" when there is nothing to say).
    reason: str = ""
    #: While ``fetching``: bytes of its slice verified, of the total, bytes a second.
    fetched: int = 0
    fetch_total: int = 0
    fetch_rate: float = 0.0
    #: Milliseconds a token spent in it over the last minute (null: not measured).
    ms_per_token: float | None = None


#: The reason of a node the instance's owner keeps it off (``meshctl place --exclude``).
OWNER = "excluded by the owner"


class ExcludedNode(msgspec.Struct, kw_only=True):
    """A node left out of an instance for good: its runner of it was given up, or the
    owner keeps the instance off it (reason :data:`OWNER`, stage and generation 0)."""

    node: str
    name: str
    #: The stage and plan generation that runner had.
    stage: int
    generation: int
    #: Why, from the node itself: it starts with one of the reasons a node gives up
    #: on a runner (``crash loop``, ``model not available here``, ``fetch failed``,
    #: ``refused by this node``), or is :data:`OWNER`.
    reason: str


class SpeedView(msgspec.Struct, kw_only=True):
    """An instance's figures over the last minute, from every node whose API sent it
    requests (``null``: nobody measured one yet)."""

    #: Tokens a second streamed, and requests in flight (sums over those nodes).
    tokens_s: float
    in_flight: int
    #: Requests holding KV on its stage 0 now, and queued there for a sequence.
    busy: int
    queue: int
    #: Time to first token, between tokens, and per hop between stages: the medians
    #: each node measured, weighted by its tokens/s.
    ttft_ms: float | None
    itl_ms: float | None
    hop_ms: float | None


class InstanceView(msgspec.Struct, kw_only=True):
    """One placed instance as the answering node sees it."""

    object: Literal["instance"] = "instance"
    id: str
    model: str
    #: The plan's generation (a repair or a drain writes the next).
    generation: int
    #: In one word: ``ready`` (it serves), ``loading``, ``fetching``, ``repairing`` (a
    #: stage lost, the survivors re-place it) or ``unrepairable`` (see that field).
    state: str
    #: ``state == "ready"``: requests are served now.
    ready: bool
    #: Activation type between adjacent MLX stages, tokens of context per request,
    #: and the llama.cpp stages' KV cache type.
    activations: str
    context: int
    kv_cache: str
    #: The instance drafting for it now (speculative decoding), if any.
    draft: str | None
    #: The default of its requests that do not say ``speculate`` (null: meshd's).
    speculate: bool | None
    #: Whether its requests that do not say ``exact`` run in the exact mode (no
    #: prefix reuse, no speculation).
    exact: bool
    #: Requests the answering node's own API runs on it now.
    in_flight: int
    #: Bytes of the model's weights (what memory and a prefill pay), and of them what
    #: one decoded token reads (less for a mixture of experts; null: facts not known).
    weight_bytes: int | None
    active_bytes: int | None
    #: Why the model runs whole on one node (null: it may be cut into stages).
    split_refusal: str | None
    #: Where it may be cut, where that is not at any layer (null: anywhere, or whole):
    #: "is cut only every 4 layers (...): 12 layers make at most 3 stage(s)".
    cut_rule: str | None
    #: What its requests run without, each with why (``speculation``,
    #: ``prefix_cache``, ``n_sharing``: off for a model with recurrent layers).
    state_refusals: dict[str, str]
    #: One request's decode tokens/s: placement's prediction from its nodes' measured
    #: speeds and links, and what the API nodes measured (0: not known yet).
    predicted_tokens_s: float
    measured_tokens_s: float
    #: Seconds placement predicts the hidden rows of a prompt as long as the context it
    #: priced take over the plan's links, at their measured bandwidth (0: one stage, or
    #: no link measured).
    predicted_transfer_s: float
    speed: SpeedView
    #: Its plan, in pipeline order.
    stages: list[StageView]
    #: Nodes left out of it for good, and why (they keep saying so after a repair
    #: moved the stage away, until the instance is deleted or they restart).
    excluded: list[ExcludedNode]
    #: Why it cannot serve and cannot be repaired (null: it can, or it serves).
    unrepairable: str | None


class InstanceList(msgspec.Struct, kw_only=True):
    """Every placed instance, by id (``GET /v1/instances``, each stream event)."""

    object: Literal["list"] = "list"
    data: list[InstanceView]


def _name(view: ClusterView, nid: str) -> str:
    card = view.cards.get(nid)
    return card.name if card is not None else nid[:8]


def _stages(
    view: ClusterView, inst: Instance, states: list[StageState], stage_ms: tuple[float | None, ...]
) -> list[StageView]:
    return [
        StageView(
            node=st.node,
            name=_name(view, st.node),
            liveness=view.liveness.get(st.node, "unknown"),
            start=st.start,
            end=st.end,
            engine=st.engine,
            state=s.state,
            reason=s.reason,
            fetched=s.fetched if s.state == "fetching" else 0,
            fetch_total=s.fetch_total if s.state == "fetching" else 0,
            fetch_rate=s.fetch_rate if s.state == "fetching" else 0.0,
            ms_per_token=stage_ms[i] if i < len(stage_ms) else None,
        )
        for i, (st, s) in enumerate(zip(inst.stages, states, strict=True))
    ]


def _speed(s: InstanceSpeed) -> SpeedView:
    return SpeedView(
        tokens_s=s.tokens_s, in_flight=s.in_flight, busy=s.busy, queue=s.queue,
        ttft_ms=s.ttft_ms, itl_ms=s.itl_ms, hop_ms=s.hop_ms,
    )  # fmt: skip


def instance_view(view: ClusterView, inst: Instance, load: Mapping[str, int] = {}) -> InstanceView:
    """What ``view`` says of ``inst`` (``load``: requests this node runs on each)."""
    states = view.stage_states(inst)
    unrepairable = view.unrepairable(inst)
    state = instance_state(states, unrepairable)
    draft = view.draft_for(inst)
    speed = view.instance_speed(inst)
    facts = inst.facts
    return InstanceView(
        id=inst.id,
        model=inst.spec.model,
        generation=inst.generation,
        state=state,
        ready=state == "ready",
        activations=inst.spec.activations,
        context=instance_context(inst),
        kv_cache=inst.spec.kv_cache,
        draft=draft[0].id if draft else None,
        speculate=inst.spec.speculate,
        exact=inst.spec.exact,
        in_flight=load.get(inst.id, 0),
        weight_bytes=facts.total_bytes if facts else None,
        active_bytes=facts.active_bytes if facts else None,
        split_refusal=split_refusal(facts) if facts else None,
        cut_rule=_cut_rule(facts),
        state_refusals=state_refusals(facts.architecture) if facts else {},
        predicted_tokens_s=view.predicted_tokens_s(inst),
        measured_tokens_s=view.measured_tokens_s(inst),
        predicted_transfer_s=_transfer_s(view, inst),
        speed=_speed(speed),
        stages=_stages(view, inst, states, speed.stage_ms),
        excluded=[
            ExcludedNode(
                node=nid,
                name=_name(view, nid),
                stage=r.stage,
                generation=r.generation,
                reason=r.reason,
            )
            for nid, r in view.gave_up_on(inst).items()
        ]
        + [
            ExcludedNode(node=nid, name=_name(view, nid), stage=0, generation=0, reason=OWNER)
            for nid in inst.spec.exclude
        ],
        unrepairable=unrepairable,
    )


def instance_list(view: ClusterView, load: Mapping[str, int] = {}) -> InstanceList:
    """Every instance ``view`` holds, by id."""
    insts = sorted(view.instances.values(), key=lambda i: i.id)
    return InstanceList(data=[instance_view(view, i, load) for i in insts])


def _transfer_s(view: ClusterView, inst: Instance) -> float:
    """Placement's predicted prefill transfer of ``inst`` over its links now."""
    if inst.facts is None:
        return 0.0
    nodes = node_resources(view.cards, view.healths, [s.node for s in inst.stages])
    spec = inst.spec
    dtype = "f32" if spec.exact else spec.activations  # the exact mode's hops
    return predicted_transfer_s(inst.facts, inst.stages, nodes.values(), dtype, spec.context)


def _cut_rule(facts: ModelFacts | None) -> str | None:
    """:attr:`InstanceView.cut_rule` of ``facts``' model."""
    if facts is None or split_refusal(facts) is not None:
        return None
    return stage_limit(facts)[1] or None

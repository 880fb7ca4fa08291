"""``/v1/instances``: place, list and remove model instances."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshd.crdt.views import Instance, InstanceSpec
from meshd.node.cluster import ClusterView, StageState
from meshd.placement import instance_context
from meshd.placement.place import KV_CACHE_TYPES
from meshd.transport.tensors import ACTIVATION_DTYPES

from .bodies import parse_body
from .errors import ApiError, node_error
from .services import context

__all__ = [
    "PlaceRequest",
    "create_instance",
    "delete_instance",
    "get_instance",
    "instance_view",
    "list_instances",
]


#: Replicas one POST /v1/instances may place.
MAX_REPLICAS = 8


class PlaceRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Body of ``POST /v1/instances``."""

    model: str
    min_nodes: int = 1
    #: Node names or ids, in stage order.
    nodes: list[str] = []
    #: Engine per stage (parallel to ``nodes``), e.g. ``["llama_cpp", "mlx"]``.
    engines: list[str] = []
    #: Activation type between adjacent MLX stages: ``f32``, ``f16`` or ``bf16``.
    activations: str = "f32"
    #: Tokens of context each request gets (0: 4096, at most the model's trained
    #: context); placement reserves KV cache for it on every stage.
    context: int = 0
    #: KV cache type of the llama.cpp stages: f16, q8_0 or q4_0 (less memory per token).
    kv_cache: str = "f16"
    #: Instances of the model to place (replicas share the requests, least busy first;
    #: each goes on nodes the others do not use while such nodes can hold it).
    replicas: int = 1
    #: The placed model that drafts for this one (speculative decoding): "" any
    #: with the same tokens and at most half the bytes, nearest first; ``none``: none.
    draft: str = ""
    #: Whether requests that do not say speculate (speculative decoding): null as
    #: meshd decides (sampled unseeded requests on a split), true all, false none.
    speculate: bool | None = None

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise ValueError("model must not be empty")
        if self.activations not in ACTIVATION_DTYPES:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATION_DTYPES)}")
        if self.min_nodes < 1:
            raise ValueError("min_nodes must be >= 1")
        if self.context < 0 or self.context > 2**31:
            raise ValueError("context must be a number of tokens (0: the default)")
        if self.kv_cache not in KV_CACHE_TYPES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_TYPES)}")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be 1 to {MAX_REPLICAS}")
        if self.engines and len(self.engines) != len(self.nodes):
            raise ValueError("engines must name one engine per entry of nodes")


def _fetch_fields(s: StageState) -> dict[str, float]:
    return {"fetched": s.fetched, "fetch_total": s.fetch_total, "fetch_rate": s.fetch_rate}


def _draft_id(view: ClusterView, inst: Instance) -> str | None:
    got = view.draft_for(inst)
    return got[0].id if got else None


def instance_view(view: ClusterView, inst: Instance, load: Mapping[str, int] = {}) -> dict:
    """The JSON shape of one instance (``load``: requests this node runs on each)."""
    states = view.stage_states(inst)
    # Nodes left out of this instance for good, and why (durable: from the nodes'
    # heartbeats, which keep a given-up runner after the stage moved away).
    excluded = [
        {"node": nid, "stage": r.stage, "generation": r.generation, "reason": r.reason}
        for nid, r in view.gave_up_on(inst).items()
    ]
    unrepairable = view.unrepairable(inst)
    return {
        "id": inst.id,
        "model": inst.spec.model,
        "generation": inst.generation,
        "activations": inst.spec.activations,
        "context": instance_context(inst),
        "kv_cache": inst.spec.kv_cache,
        #: The instance drafting for it now (speculative decoding), if any.
        "draft": _draft_id(view, inst),
        #: The default of its requests that do not say ``speculate`` (null: meshd's).
        "speculate": inst.spec.speculate,
        #: Requests the answering node's API runs on this instance now.
        "in_flight": load.get(inst.id, 0),
        #: One request's decode tokens/s: placement's prediction from its nodes'
        #: measured speeds and links, and what the API nodes measured (0: not yet).
        "predicted_tokens_s": view.predicted_tokens_s(inst),
        "measured_tokens_s": view.measured_tokens_s(inst),
        "stages": [
            {
                "node": st.node,
                "start": st.start,
                "end": st.end,
                "engine": st.engine,
                "state": s.state,
                **({"reason": s.reason} if s.reason else {}),
                **(_fetch_fields(s) if s.state == "fetching" else {}),
            }
            for st, s in zip(inst.stages, states, strict=True)
        ],
        **({"excluded": excluded} if excluded else {}),
        **({"unrepairable": unrepairable} if unrepairable else {}),
    }


async def create_instance(request: Request) -> Response:
    """``POST /v1/instances``: place a model as asked."""
    body = await parse_body(request, PlaceRequest)
    services = context(request).services
    spec = InstanceSpec(
        model=body.model,
        min_nodes=body.min_nodes,
        nodes=body.nodes,
        engines=body.engines,
        activations=body.activations,
        context=body.context,
        kv_cache=body.kv_cache,
        draft=body.draft.strip(),
        speculate=body.speculate,
    )
    placed = []
    try:
        for _ in range(body.replicas):
            placed.append(await services.place(spec))
    except Exception as e:
        err = node_error(e, body.model, placing=True)
        if err is None:
            raise
        if placed:  # the replicas placed so far stay; say how many did
            err.message += f" ({len(placed)} of {body.replicas} replicas placed)"
        raise err from None
    view, load = services.view(), services.instance_load()
    if body.replicas == 1:
        return JSONResponse(instance_view(view, placed[0], load), status_code=201)
    data = [instance_view(view, i, load) for i in placed]
    return JSONResponse({"object": "list", "data": data}, status_code=201)


async def list_instances(request: Request) -> Response:
    """``GET /v1/instances``."""
    services = context(request).services
    view, load = services.view(), services.instance_load()
    insts = sorted(view.instances.values(), key=lambda i: i.id)
    return JSONResponse({"object": "list", "data": [instance_view(view, i, load) for i in insts]})


async def get_instance(request: Request) -> Response:
    """``GET /v1/instances/{id}``."""
    iid = request.path_params["instance_id"]
    services = context(request).services
    view = services.view()
    inst = view.instances.get(iid)
    if inst is None:
        raise _no_instance(iid)
    return JSONResponse(instance_view(view, inst, services.instance_load()))


async def delete_instance(request: Request) -> Response:
    """``DELETE /v1/instances/{id}``."""
    iid = request.path_params["instance_id"]
    if not context(request).services.remove(iid):
        raise _no_instance(iid)
    return JSONResponse({"id": iid, "object": "instance", "deleted": True})


def _no_instance(iid: str) -> ApiError:
    return ApiError(404, f"no instance {iid!r}", type="not_found_error", code="not_found")

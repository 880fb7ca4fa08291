"""``/v1/instances``: place, list, watch and remove model instances.

Every answer about an instance is an :class:`~.instance_view.InstanceView`: the node's
own view of it. ``GET /v1/instances/stream`` sends the whole list as Server-Sent
Events: one at once, then a new one whenever it changed, paced as every stream is
(``snapshots.py``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshd.crdt.views import InstanceSpec
from meshd.placement.policy import KV_CACHE_TYPES, MAX_SEATS
from meshd.transport.dtypes import ACTIVATION_DTYPES

from .bodies import parse_body
from .errors import ApiError, node_error
from .instance_view import InstanceList, instance_list, instance_view
from .services import Services, context
from .snapshots import snapshot_events
from .sse import sse_response

__all__ = [
    "PlaceRequest",
    "create_instance",
    "delete_instance",
    "get_instance",
    "instance_snapshots",
    "list_instances",
    "stream_instances",
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
    #: Wire type of the hidden rows between stages: ``f16`` (half the bytes),
    #: ``bf16`` or ``f32``; requests in the exact mode send ``f32`` whatever it says.
    activations: str = "f16"
    #: Tokens of context each request gets (0: the model's trained context as far as
    #: memory allows, see ``meshd.placement.place.default_context``); placement
    #: reserves KV cache for it on every stage.
    context: int = 0
    #: KV cache type of the llama.cpp stages: f16, q8_0 or q4_0 (less memory per token).
    kv_cache: str = "f16"
    #: Requests each stage holds KV for at once (0: 8); placement reserves KV for
    #: each, and a split steps more of them in flight (micro-batches at once).
    seats: int = 0
    #: Instances of the model to place (replicas share the requests, least busy first;
    #: no two share a node: more than the nodes can hold is a 409 and places none).
    replicas: int = 1
    #: Keep the model's automatic instance (the one a request placed on its own):
    #: without it, this placement takes its place (the model moves).
    keep: bool = False
    #: The placed model that drafts for this one (speculative decoding): "" any
    #: with the same tokens and at most half the bytes, nearest first; ``none``: none.
    draft: str = ""
    #: Whether requests that do not say speculate (speculative decoding): null as
    #: meshd decides (sampled unseeded requests on a split), true all, false none.
    speculate: bool | None = None
    #: The exact mode for requests that do not say ``exact``: no prefix reuse, no
    #: speculation (bit-identical answers whatever ran before; slower).
    exact: bool = False
    #: Node names or ids the model must never run on (stored as ids).
    exclude: list[str] = []

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
        if not 0 <= self.seats <= MAX_SEATS:
            raise ValueError(f"seats must be 1 to {MAX_SEATS} (0: the default, 8)")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be 1 to {MAX_REPLICAS}")
        if self.engines and len(self.engines) != len(self.nodes):
            raise ValueError("engines must name one engine per entry of nodes")
        if any(not x.strip() for x in self.exclude):
            raise ValueError("exclude must name nodes (names or ids)")
        if set(self.exclude) & set(self.nodes):
            raise ValueError("a node cannot be both pinned (nodes) and excluded")
        if self.replicas > 1 and self.nodes:
            raise ValueError("replicas go on different nodes: pinned nodes take one (drop nodes)")


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
        seats=body.seats,
        draft=body.draft.strip(),
        speculate=body.speculate,
        exact=body.exact,
        exclude=[x.strip() for x in body.exclude],
    )
    try:
        placed = await services.place(spec, body.replicas, body.keep)
    except Exception as e:
        err = node_error(e, body.model, placing=True)
        if err is None:
            raise
        raise err from None
    view, load = services.view(), services.instance_load()
    if body.replicas == 1:
        return _json(instance_view(view, placed[0], load), status_code=201)
    data = [instance_view(view, i, load) for i in placed]
    return _json(InstanceList(data=data), status_code=201)


async def list_instances(request: Request) -> Response:
    """``GET /v1/instances``: every instance, as this node sees it."""
    services = context(request).services
    return _json(instance_list(services.view(), services.instance_load()))


async def stream_instances(request: Request) -> Response:
    """``GET /v1/instances/stream``: the list of ``GET /v1/instances`` as Server-Sent
    Events, at once and then at every change (see the module doc). A ``HEAD`` gets
    the headers alone: the stream never ends by itself."""
    if request.method == "HEAD":
        return Response(media_type="text/event-stream")
    return sse_response(instance_snapshots(context(request).services))


def instance_snapshots(
    services: Services, clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[bytes]:
    """The events of the stream: the list whenever it differs from the one sent last
    (``snapshots.py``), until the client goes or the node drains."""
    return snapshot_events(
        services, lambda: instance_list(services.view(), services.instance_load()), clock
    )


async def get_instance(request: Request) -> Response:
    """``GET /v1/instances/{id}``."""
    iid = request.path_params["instance_id"]
    services = context(request).services
    view = services.view()
    inst = view.instances.get(iid)
    if inst is None:
        raise _no_instance(iid)
    return _json(instance_view(view, inst, services.instance_load()))


async def delete_instance(request: Request) -> Response:
    """``DELETE /v1/instances/{id}``."""
    iid = request.path_params["instance_id"]
    if not context(request).services.remove(iid):
        raise _no_instance(iid)
    return JSONResponse({"id": iid, "object": "instance", "deleted": True})


def _json(body: msgspec.Struct, status_code: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code, media_type="application/json")


def _no_instance(iid: str) -> ApiError:
    return ApiError(404, f"no instance {iid!r}", type="not_found_error", code="not_found")

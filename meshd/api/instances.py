"""``/v1/instances``: place, list and remove model instances."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshd.crdt.views import InstanceSpec, instances
from meshd.models.resolve import AmbiguousModelError, ModelNotFoundError, canonical_name
from meshd.placement import PlacementError
from meshd.transport.tensors import ACTIVATION_DTYPES

from .bodies import parse_body
from .errors import ApiError, bad_request


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

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise ValueError("model must not be empty")
        if self.activations not in ACTIVATION_DTYPES:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATION_DTYPES)}")
        if self.min_nodes < 1:
            raise ValueError("min_nodes must be >= 1")
        if self.engines and len(self.engines) != len(self.nodes):
            raise ValueError("engines must name one engine per entry of nodes")


def instance_view(node, inst) -> dict:
    """The JSON shape of one instance."""
    states = node.inference.stage_states(inst)
    # Nodes left out of this instance for good, and why (durable: from the nodes'
    # heartbeats, which keep a given-up runner after the stage moved away).
    excluded = [
        {"node": nid, "stage": r.stage, "generation": r.generation, "reason": r.reason}
        for nid, r in node.inference.gave_up_on(inst).items()
    ]
    unrepairable = node.inference.unrepairable(inst)
    return {
        "id": inst.id,
        "model": inst.spec.model,
        "generation": inst.generation,
        "activations": inst.spec.activations,
        "stages": [
            {
                "node": st.node,
                "start": st.start,
                "end": st.end,
                "engine": st.engine,
                "state": s.state,
                **({"reason": s.reason} if s.reason else {}),
            }
            for st, s in zip(inst.stages, states, strict=True)
        ],
        **({"excluded": excluded} if excluded else {}),
        **({"unrepairable": unrepairable} if unrepairable else {}),
    }


async def _check_mlx(model: str, pinned: bool) -> None:
    """Refuse, before anything runs, a model MLX would read wrongly or not at all: a
    GGUF pinned to MLX stages, or any MLX folder (only MLX can run one)."""
    import asyncio

    from meshd.models.errors import UnsupportedModelError
    from meshd.models.folder import check_folder_for_mlx
    from meshd.models.mlx_layout import check_gguf_for_mlx
    from meshd.models.resolve import resolve_model

    try:
        resolved = resolve_model(model)
    except LookupError:
        return  # not on this machine: facts() says where it looked, or finds it
    if resolved.format == "gguf" and not pinned:
        return
    check = check_gguf_for_mlx if resolved.format == "gguf" else check_folder_for_mlx
    try:
        await asyncio.to_thread(check, resolved.path)
    except UnsupportedModelError as e:
        raise ApiError(
            400, f"{model} cannot run on MLX: {e}", type="invalid_request_error",
            param="engines", code="unsupported_quant",
        ) from None  # fmt: skip


def routes(node):
    """Handlers bound to ``node``."""

    async def create(request: Request) -> Response:
        body = await parse_body(request, PlaceRequest)
        try:
            await _check_mlx(body.model, pinned="mlx" in body.engines)
            facts = await node.inference.facts(body.model, node.cache_dir)
        except (ModelNotFoundError, AmbiguousModelError) as e:
            raise ApiError(404, str(e), type="not_found_error", code="model_not_found") from None
        except PlacementError as e:
            raise bad_request(str(e), code=e.reason) from None
        except ValueError as e:
            raise bad_request(f"{body.model}: {e}", param="model") from None
        spec = InstanceSpec(
            model=canonical_name(body.model),
            min_nodes=body.min_nodes,
            nodes=body.nodes,
            engines=body.engines,
            activations=body.activations,
        )
        try:
            inst = await node.inference.create_instance(spec, facts)
        except PlacementError as e:
            status = 400 if e.reason in ("unknown_node", "bad_spec") else 409
            raise ApiError(status, str(e), type="invalid_request_error", code=e.reason) from None
        return JSONResponse(instance_view(node, inst), status_code=201)

    async def list_(request: Request) -> Response:
        insts = sorted(instances(node.replica.map).values(), key=lambda i: i.id)
        return JSONResponse({"object": "list", "data": [instance_view(node, i) for i in insts]})

    async def delete(request: Request) -> Response:
        iid = request.path_params["instance_id"]
        if not node.inference.delete_instance(iid):
            raise ApiError(404, f"no instance {iid!r}", type="not_found_error", code="not_found")
        return JSONResponse({"id": iid, "object": "instance", "deleted": True})

    async def get(request: Request) -> Response:
        iid = request.path_params["instance_id"]
        inst = instances(node.replica.map).get(iid)
        if inst is None:
            raise ApiError(404, f"no instance {iid!r}", type="not_found_error", code="not_found")
        return JSONResponse(instance_view(node, inst))

    return create, list_, get, delete

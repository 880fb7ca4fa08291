"""Ollama's model routes: what the cluster serves, in Ollama's shapes.

``/api/tags`` lists every model a live node holds or an instance serves, ``/api/ps``
the placed instances, ``/api/show`` one model's facts, ``/api/pull`` places a model
(meshd downloads nothing: the file must be on some node), ``/api/delete`` removes its
instances (the file stays). A name may carry Ollama's ``:latest`` tag.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from meshd.domain.facts import ModelFacts
from meshd.domain.keepalive import expires, live_words
from meshd.node.cluster import ClusterView, instance_state
from meshd.node.errors import ModelLoading

from . import ollama_replies as replies
from . import ollama_schemas as o
from .bodies import parse_body
from .errors import ApiError, model_not_found, node_error
from .ollama_embed import ollama_model as _model
from .services import context

__all__ = ["delete", "ps", "pull", "show", "tags"]

#: ``/api/ps``'s expiry of an instance kept forever, or of one no API node has said a
#: keep-alive for (its nodes' own default runs from their last request).
_NEVER = "9999-12-31T23:59:59Z"
#: How long ``/api/pull`` waits for a model's instance to become ready.
PULL_TIMEOUT_S = 600.0


def _facts(view: ClusterView, name: str) -> ModelFacts | None:
    inst = view.find_instance(name)
    if inst is not None and inst.facts is not None:
        return inst.facts
    return view.facts_from_peers(name)


def _size(f: ModelFacts | None) -> int:
    return 0 if f is None else sum(f.layer_bytes) + f.embed_bytes + f.head_bytes


def _details(f: ModelFacts | None) -> replies.ModelDetails:
    if f is None:
        return replies.ModelDetails(format="gguf", family="", families=[])
    quants = [q for q in f.quant_types if q not in ("F32",)] or f.quant_types
    return replies.ModelDetails(
        format=f.format, family=f.architecture, families=[f.architecture],
        parameter_size=f.parameter_size, quantization_level=quants[0] if quants else "",
    )  # fmt: skip


_EPOCH = "1970-01-01T00:00:00Z"


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


async def tags(request: Request) -> Response:
    """``GET /api/tags``: every model the cluster can serve."""
    view = context(request).services.view()
    models = []
    for name in view.known_models():
        f = _facts(view, name)
        models.append(replies.TagsEntry(
            name=name, model=name, modified_at=_EPOCH, size=_size(f),
            digest=f.sha256 if f else "", details=_details(f),
        ))  # fmt: skip
    return Response(
        msgspec.json.encode(replies.TagsResponse(models=models)), media_type="application/json"
    )


async def ps(request: Request) -> Response:
    """``GET /api/ps``: the instances loaded now (as Ollama lists the models in memory:
    one unloaded after its keep-alive is not), each with when its keep-alive ends."""
    view = context(request).services.view()
    words = live_words(view.healths, view.is_live)
    models = []
    for inst in sorted(view.instances.values(), key=lambda i: i.id):
        if instance_state(view.stage_states(inst), view.unrepairable(inst)) == "unloaded":
            continue
        f, ends = inst.facts, expires(words.get(inst.id, []))
        models.append(replies.PsEntry(
            name=inst.spec.model, model=inst.spec.model, size=_size(f),
            digest=f.sha256 if f else "", details=_details(f),
            expires_at=_NEVER if ends is None else _rfc3339(ends),
            size_vram=0, context_length=f.n_ctx_train if f else 0,
        ))  # fmt: skip
    return replies.json_response(replies.PsResponse(models=models))


async def show(request: Request) -> Response:
    """``POST /api/show``: a model's details, ``model_info`` and capabilities."""
    body = await parse_body(request, o.ModelRequest)
    ctx = context(request)
    name = _model(ctx, body.model_name)
    view = ctx.services.view()
    if not view.is_known(name):
        raise model_not_found(body.model_name, view.known_models())
    f = _facts(view, name)
    info: dict[str, object] = {}
    caps = ["embedding"] if f is not None and f.embedding_only else ["completion", "tools"]
    if f is not None:
        a = f.architecture
        info = {
            "general.architecture": a,
            "general.parameter_count": f.n_params,
            f"{a}.context_length": f.n_ctx_train,
            f"{a}.block_count": f.n_layers,
            f"{a}.embedding_length": f.hidden_size,
        }
    resp = replies.ShowResponse(
        modelfile="", parameters="", template="", details=_details(f), model_info=info,
        capabilities=caps, modified_at=_EPOCH,
    )  # fmt: skip
    return replies.json_response(resp)


async def pull(request: Request) -> Response:
    """``POST /api/pull``: place the model on the cluster and wait until it serves.

    meshd fetches no weights from a registry: a model is pullable when some node holds
    its file (or resolves its name). Streams Ollama's status objects.
    """
    body = await parse_body(request, o.ModelRequest)
    ctx = context(request)
    model = _model(ctx, body.model_name)
    deadline = time.monotonic() + PULL_TIMEOUT_S

    async def ready() -> None:
        while True:
            try:
                await ctx.services.instance_for(model)
                return
            except ModelLoading:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)
            except Exception as e:
                err = node_error(e, model, placing=True)
                if err is None:
                    raise
                raise err from None

    if not body.stream:
        await ready()
        return replies.json_response({"status": "success"})
    # Errors before the stream starts are plain HTTP errors; a failure after it is a
    # final {"error": ...} line, as Ollama sends.
    task = asyncio.ensure_future(ready())
    done, _ = await asyncio.wait({task}, timeout=0.5)
    if done:
        task.result()

    async def lines() -> AsyncIterator[bytes]:
        yield msgspec.json.encode({"status": f"placing {model} on the cluster"}) + b"\n"
        try:
            await task
        except ApiError as e:
            yield replies.error_line(e)
            return
        yield msgspec.json.encode({"status": "success"}) + b"\n"

    return StreamingResponse(lines(), media_type=replies.NDJSON)


async def delete(request: Request) -> Response:
    """``DELETE /api/delete``: remove the model's instances (its file stays on disk)."""
    body = await parse_body(request, o.ModelRequest)
    ctx = context(request)
    name = _model(ctx, body.model_name)
    view = ctx.services.view()
    ids = [i.id for i in view.instances.values() if i.spec.model == name]
    inst = view.find_instance(name)
    if inst is not None and inst.id not in ids:
        ids.append(inst.id)
    if not ids:
        raise ApiError(404, f"model '{body.model_name}' is not placed in this cluster",
                       type="not_found_error", code="model_not_found")  # fmt: skip
    for iid in ids:
        ctx.services.remove(iid)
    return Response(status_code=200)

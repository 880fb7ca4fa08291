"""Ollama's embeddings routes, ``/api/embed`` and the older ``/api/embeddings``
(re-exported by :mod:`.ollama`), and the rule every Ollama route names models by
(:func:`ollama_model`)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from . import ollama_replies as replies
from . import ollama_schemas as o
from .answers import client_closed
from .bodies import parse_body
from .embeddings import embed_inputs, float32_list
from .errors import bad_request
from .gone import unless_gone
from .services import ApiContext, context

__all__ = ["embed", "embeddings", "ollama_model"]


def ollama_model(ctx: ApiContext, name: str) -> str:
    """``name`` as the cluster knows it: Ollama clients add ``:latest``."""
    name = name.strip()
    view = ctx.services.view()
    if not view.is_known(name) and name.endswith(":latest"):
        bare = name.removesuffix(":latest")
        if view.is_known(bare):
            return bare
    return name


async def _vectors(request: Request, model: str, inputs: list[str]) -> tuple[list, int, int]:
    ctx = context(request)
    t0 = time.perf_counter()
    got = await unless_gone(embed_inputs(ctx, ollama_model(ctx, model), list(inputs)), request)
    if got is None:
        raise _Gone
    vectors = [float32_list(c.embedding) for c in got]
    return vectors, sum(c.usage.prompt_tokens for c in got), int((time.perf_counter() - t0) * 1e9)


class _Gone(Exception):
    """The client left before the vectors were ready."""


async def embed(request: Request) -> Response:
    """``POST /api/embed``: one vector per input, unit length (as Ollama's)."""
    body = await parse_body(request, o.EmbedRequest)
    if not body.inputs or any(not x for x in body.inputs):
        raise bad_request(
            "input must be a non-empty string or list of non-empty strings", param="input"
        )
    try:
        vectors, n, took = await _vectors(request, body.model, body.inputs)
    except _Gone:
        return client_closed()
    if body.dimensions is not None and body.dimensions != len(vectors[0]):
        raise bad_request(
            f"dimensions {body.dimensions} is not supported: this model's embeddings have "
            f"{len(vectors[0])}", param="dimensions",
        )  # fmt: skip
    resp = replies.EmbedResponse(model=body.model, embeddings=vectors, total_duration=took,
                           load_duration=0, prompt_eval_count=n)  # fmt: skip
    return replies.json_response(resp)


async def embeddings(request: Request) -> Response:
    """``POST /api/embeddings`` (Ollama's older route): one prompt, one vector."""
    body = await parse_body(request, o.EmbeddingsRequest)
    if not body.prompt:
        raise bad_request("prompt must be a non-empty string", param="prompt")
    try:
        vectors, _, _ = await _vectors(request, body.model, [body.prompt])
    except _Gone:
        return client_closed()
    return replies.json_response(replies.EmbeddingsResponse(embedding=vectors[0]))

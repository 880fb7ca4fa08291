"""``POST /v1/embeddings``, OpenAI-compatible.

Each input is one request through the pipeline, as a chat is: stage 0 tokenizes it (or
takes its token ids), every stage runs its layers, and the last stage pools the final
hidden states into one unit vector (``meshd.models.pooling``), so whole and split
instances answer alike. A few inputs run at once: the stages batch them.
"""

from __future__ import annotations

import array
import asyncio
import base64
import sys

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from meshd.node.errors import RequestFailed

from . import embedding_schemas as schemas
from .answers import client_closed
from .bodies import parse_body
from .errors import bad_request, request_failed
from .runs import Collected, GenerateRequest, admit, unless_gone
from .services import ApiContext, context

__all__ = ["MAX_PARALLEL_INPUTS", "embed_inputs", "embeddings", "float32_list"]

#: Inputs of one request in flight at once (each holds a request slot of the node).
MAX_PARALLEL_INPUTS = 8


async def embeddings(request: Request) -> Response:
    """``POST /v1/embeddings``."""
    body = await parse_body(request, schemas.EmbeddingRequest)
    ctx = context(request)
    vectors = await unless_gone(embed_inputs(ctx, body.model, body.inputs), request)
    if vectors is None:
        return client_closed()
    width = len(vectors[0].embedding) // 4
    if body.dimensions is not None and body.dimensions != width:
        raise bad_request(
            f"dimensions {body.dimensions} is not supported: this model's embeddings have "
            f"{width} (send it, or leave dimensions out)",
            param="dimensions",
            code="unsupported_parameter",
        )
    data = [
        schemas.Embedding(index=i, embedding=_encoded(v.embedding, body.encoding_format))
        for i, v in enumerate(vectors)
    ]
    n = sum(v.usage.prompt_tokens for v in vectors)
    resp = schemas.EmbeddingList(
        data=data, model=body.model, usage=schemas.EmbeddingUsage(prompt_tokens=n, total_tokens=n)
    )
    return Response(msgspec.json.encode(resp), media_type="application/json")


def _encoded(vector: bytes, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vector).decode("ascii")
    return float32_list(vector)


def float32_list(vector: bytes) -> list[float]:
    """An embedding as the wire carries it (little-endian float32) as Python floats."""
    floats = array.array("f", vector)
    if sys.byteorder == "big":
        floats.byteswap()
    return floats.tolist()


async def embed_inputs(
    ctx: ApiContext, model: str, items: list[str | list[int]]
) -> list[Collected]:
    """Every input's vector (text or token ids), in order; the first failure cancels
    the rest (every dialect's embeddings route runs through here)."""
    gate = asyncio.Semaphore(MAX_PARALLEL_INPUTS)

    async def one(item: str | list[int]) -> Collected:
        req = GenerateRequest(
            model=model,
            prompt=item if isinstance(item, str) else None,
            prompt_tokens=item if isinstance(item, list) else None,
            embed=True,
        )
        async with gate:
            run = await admit(ctx, "embeddings", req)
            try:
                got = await run.collect()
            except RequestFailed as e:
                run.count(str(e.status))
                raise request_failed(e) from None
            finally:
                await run.close()
            run.count("200")
            return got

    tasks = [asyncio.ensure_future(one(item)) for item in items]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

"""OpenAI-compatible routes: chat completions, completions, models.

A thin adapter: the body is parsed into a :class:`~.runs.GenerateRequest`, the request
runs through :mod:`meshd.api.runs`, and the chunks come back in OpenAI's shapes,
streamed as SSE or collected. Errors before the first byte are HTTP errors in OpenAI's
shape; errors after it are an SSE error event followed by ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from meshd.node.errors import RequestFailed
from meshd.node.requests import KEEPALIVE
from meshd.transport import wire

from . import schemas
from .bodies import parse_body
from .errors import request_failed
from .runs import GenerateRequest, Run, admit
from .sampling import SamplingRequest
from .services import context
from .sse import SSE_DONE, SSE_KEEPALIVE, sse_data, sse_error, sse_response

__all__ = ["chat_completions", "completions", "list_models"]

_Body = schemas.ChatCompletionRequest | schemas.CompletionRequest


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    body = await parse_body(request, schemas.ChatCompletionRequest)
    turns = [wire.ChatTurn(m.role, m.text) for m in body.messages]
    return await _serve(request, body, _generate_request(body, messages=turns), "chat")


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    body = await parse_body(request, schemas.CompletionRequest)
    return await _serve(
        request, body, _generate_request(body, prompt=body.prompt_text), "completions"
    )


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: every model the cluster can serve."""
    names = context(request).services.view().known_models()
    data = schemas.ModelList(data=[schemas.Model(id=n) for n in names])
    return Response(msgspec.json.encode(data), media_type="application/json")


def _generate_request(
    body: _Body, *, messages: list[wire.ChatTurn] | None = None, prompt: str | None = None
) -> GenerateRequest:
    return GenerateRequest(
        model=body.model,
        messages=messages,
        prompt=prompt,
        max_tokens=body.max_new_tokens,
        sampling=SamplingRequest(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repeat_penalty=body.repeat_penalty,
            repeat_last_n=body.repeat_last_n,
            logit_bias=body.token_bias,
            seed=body.seed,
        ),
        stop=body.stop_sequences,
        ignore_eos=body.ignore_eos,
    )


async def _serve(request: Request, body: _Body, req: GenerateRequest, route: str) -> Response:
    run = await admit(context(request), route, req)
    if body.stream:
        events = _stream(run, body, chat=route == "chat")
        # Backstop: a stream the server never starts (client gone before the first
        # byte) never runs its finally; its slot comes back when it is freed.
        weakref.finalize(events, run.ticket.release)
        return sse_response(events)
    try:
        return await _whole(request, run, body, chat=route == "chat")
    finally:
        await run.close()


async def _whole(request: Request, run: Run, body: _Body, *, chat: bool) -> Response:
    try:
        got = await run.collect_unless_gone(request)
    except RequestFailed as e:
        run.count(str(e.status))
        raise request_failed(e) from None
    if got is None:
        run.count("client_closed")
        return Response(status_code=499)
    run.count("200")
    u = schemas.Usage.of(got.usage.prompt_tokens, got.usage.completion_tokens)
    if chat:
        resp: msgspec.Struct = schemas.ChatCompletion.single(
            model=body.model, content=got.text, finish_reason=got.finish_reason, usage=u
        )
    else:
        resp = schemas.Completion.single(
            model=body.model, text=got.text, finish_reason=got.finish_reason, usage=u
        )
    return Response(msgspec.json.encode(resp), media_type="application/json")


async def _stream(run: Run, body: _Body, *, chat: bool) -> AsyncIterator[bytes]:
    s = schemas.ChatStream(body.model) if chat else schemas.CompletionStream(body.model)
    outcome = "200"
    try:
        if chat:
            yield sse_data(s.start())
        usage = None
        async with contextlib.aclosing(run.pieces()) as it:
            async for c in it:
                if c is KEEPALIVE:
                    # The pipeline broke and the request waits for its repair.
                    yield SSE_KEEPALIVE
                    continue
                if c.text:
                    yield sse_data(s.content(c.text))
                if c.finish_reason:
                    usage = c.usage
                    yield sse_data(s.finish(c.finish_reason))
        if body.include_usage and usage is not None:
            yield sse_data(s.usage(schemas.Usage.of(usage.prompt_tokens, usage.completion_tokens)))
        yield SSE_DONE
    except RequestFailed as e:
        outcome = str(e.status)
        yield sse_error(request_failed(e))
        yield SSE_DONE
    finally:
        await run.close()
        run.count(outcome)

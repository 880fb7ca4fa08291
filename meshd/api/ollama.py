"""Ollama's API on the node's own port: ``/api/chat``, ``/api/generate``, ``/api/embed``,
and ``/api/version``; a thin adapter like :mod:`.openai`.

Bodies parse into the one :class:`~.runs.GenerateRequest`; answers come from
:mod:`.answers` and are written as Ollama writes them: NDJSON objects, one per piece,
the last with ``done: true`` and the timings, or one object when ``stream`` is false.
Errors are ``{"error": "..."}`` (see :func:`~.errors.dialect_of`).

Timings are measured on the node that serves the request, in nanoseconds:
``load_duration`` is the wait for the model's instance (placing it when needed) and
stage 0's acknowledgement, ``prompt_eval_duration`` from there to the first token
(prefill through every stage), ``eval_duration`` from the first token to the last, and
``total_duration`` the whole request.

The model routes (``/api/tags``, ``ps``, ``show``, ``pull``, ``delete``) are in
:mod:`.ollama_models`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from meshd.domain.chat import ChatTurn, ToolCallTurn, ToolSpec, ToolUse
from meshd.domain.sampling import SamplingChoice
from meshd.transport import wire

from . import ollama_replies as replies
from . import ollama_schemas as o
from .answers import (
    Called,
    Finished,
    KeepAlive,
    Text,
    Thought,
    answer,
    client_closed,
    events,
    streamed,
    whole,
)
from .bodies import parse_body
from .errors import ApiError
from .images import image_turn
from .logprobs import chat_logprobs
from .ollama_embed import embed, embeddings
from .ollama_embed import ollama_model as _model
from .runs import GenerateRequest, Run, admit, load_only
from .services import ApiContext, context
from .toolcalls import Call, ChoiceCalls, json_text

__all__ = [
    "COMPAT_VERSION",
    "chat",
    "embed",
    "embeddings",
    "generate",
    "not_supported",
    "root",
    "version",
]

#: The Ollama version whose API this adapter follows. Clients compare it with the
#: versions they need (GitHub Copilot wants a number here, not meshd's own version).
COMPAT_VERSION = "0.12.6"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


async def root(request: Request) -> Response:
    """``GET /`` and ``HEAD /``: what Ollama clients probe to find a server."""
    return PlainTextResponse("Ollama is running")


async def version(request: Request) -> Response:
    """``GET /api/version``."""
    return replies.json_response({"version": COMPAT_VERSION})


# ---------------------------------------------------------------------------------------
# generation


def _sampling(opts: o.Options) -> SamplingChoice:
    return SamplingChoice(
        temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, min_p=opts.min_p,
        presence_penalty=opts.presence_penalty, frequency_penalty=opts.frequency_penalty,
        repeat_penalty=opts.repeat_penalty, repeat_last_n=opts.repeat_last_n, seed=opts.seed,
    )  # fmt: skip


def _turn(m: o.Message) -> ChatTurn:
    calls = [
        ToolCallTurn(f"call_{i}", c.function.name, json_text(c.function.arguments))
        for i, c in enumerate(m.tool_calls or ())
    ]
    return image_turn(m.role, m.content, m.images, calls, m.tool_name, m.thinking)


def _request(
    ctx: ApiContext,
    body: o.ChatRequest | o.GenerateRequest,
    *,
    messages: list[ChatTurn] | None = None,
    prompt: str | None = None,
) -> GenerateRequest:
    opts = body.opts
    tools = None
    if isinstance(body, o.ChatRequest) and body.tool_mode is not None:
        fs = [t.function for t in body.tools or ()]
        specs = [ToolSpec(name=f.name, description=f.description, parameters=f.parameters)
                 for f in fs]  # fmt: skip
        tools = ToolUse(tools=specs, choice=body.tool_mode)
    return GenerateRequest(
        model=_model(ctx, body.model), messages=messages, prompt=prompt,
        max_tokens=opts.max_tokens, max_tokens_param="options.num_predict",
        context=opts.num_ctx or 0, sampling=_sampling(opts), stop=list(opts.stop or []),
        logprobs=body.n_logprobs, grammar=body.grammar, tools=tools, think=body.think_choice,
        exact=body.exact if body.exact is not None else opts.exact,
        keep_alive=o.keep_alive_seconds(body.keep_alive),
    )  # fmt: skip


async def chat(request: Request) -> Response:
    """``POST /api/chat``."""
    body = await parse_body(request, o.ChatRequest)
    ctx = context(request)
    if not body.messages:
        return await _load_only(ctx, body, chat=True)
    req = _request(ctx, body, messages=[_turn(m) for m in body.messages])
    return await _serve(request, ctx, body, req, chat=True)


async def generate(request: Request) -> Response:
    """``POST /api/generate``."""
    body = await parse_body(request, o.GenerateRequest)
    ctx = context(request)
    if not body.prompt:
        return await _load_only(ctx, body, chat=False)
    if body.raw:
        req = _request(ctx, body, prompt=body.prompt)
    else:
        turns = [ChatTurn("system", body.system)] if body.system else []
        req = _request(ctx, body, messages=[*turns, image_turn("user", body.prompt, body.images)])
    return await _serve(request, ctx, body, req, chat=False)


async def _load_only(
    ctx: ApiContext, body: o.ChatRequest | o.GenerateRequest, *, chat: bool
) -> Response:
    """An empty prompt: Ollama loads the model and answers ``done_reason: "load"``."""
    t0 = time.perf_counter()
    model = _model(ctx, body.model)
    await load_only(ctx, model, body.opts.num_ctx or 0, o.keep_alive_seconds(body.keep_alive))
    took = int((time.perf_counter() - t0) * 1e9)
    common: dict[str, Any]  # each field's own type: the response Struct checks them
    common = {"model": body.model, "created_at": _now(), "done": True, "done_reason": "load",
              "total_duration": took, "load_duration": took}  # fmt: skip
    resp: msgspec.Struct
    if chat:
        resp = replies.ChatResponse(
            message=replies.AssistantMessage(role="assistant", content=""), **common
        )
    else:
        resp = replies.GenerateResponse(response="", **common)
    return _one(resp, stream=body.stream)


def _one(obj: msgspec.Struct, *, stream: bool) -> Response:
    if stream:
        return Response(msgspec.json.encode(obj) + b"\n", media_type=replies.NDJSON)
    return replies.json_response(obj)


def _timings(run: Run, usage: wire.Usage) -> dict:
    """The measured timings of a finished run, in nanoseconds (see the module doc)."""
    now = time.perf_counter()
    first = run.t_first or now
    return {
        "total_duration": int((now - run.t0) * 1e9),
        "load_duration": int((run.t_acked - run.t0) * 1e9),
        "prompt_eval_count": usage.prompt_tokens,
        "prompt_eval_duration": int((first - run.t_acked) * 1e9),
        "eval_count": usage.completion_tokens,
        "eval_duration": int(((run.t_last or first) - first) * 1e9),
    }


def _done_reason(reason: str) -> str:
    # Ollama ends an answer that called tools with "stop".
    return "length" if reason == "length" else "stop"


def _tool_calls(calls: list[Call]) -> list[o.ToolCall] | None:
    if not calls:
        return None
    return [
        o.ToolCall(function=o.ToolCallFunction(name=c.name, arguments=c.arguments_object()))
        for c in calls
    ]


def _piece(
    body: o.ChatRequest | o.GenerateRequest,
    *,
    chat: bool,
    text: str = "",
    calls: list[Call] | None = None,
    logprobs: list[wire.TokenLogprob] | None = None,
    thinking: str = "",
    **done: object,
) -> msgspec.Struct:
    lp = chat_logprobs(logprobs).content if logprobs else None
    common: dict[str, Any]  # each field's own type: the response Struct checks them
    common = {"model": body.model, "created_at": _now(), "done": False, "logprobs": lp, **done}
    if chat:
        calls_ = _tool_calls(calls or [])
        msg = replies.AssistantMessage(role="assistant", content=text, tool_calls=calls_,
                                 thinking=thinking or None)  # fmt: skip
        return replies.ChatResponse(message=msg, **common)
    return replies.GenerateResponse(response=text, thinking=thinking or None, **common)


def _calls(body: o.ChatRequest | o.GenerateRequest, run: Run) -> ChoiceCalls | None:
    if isinstance(body, o.ChatRequest) and body.tool_mode is not None:
        return ChoiceCalls(run.tool_format, tools=run.tools)
    return None


async def _serve(
    request: Request,
    ctx: ApiContext,
    body: o.ChatRequest | o.GenerateRequest,
    req: GenerateRequest,
    *,
    chat: bool,
) -> Response:
    run = await admit(ctx, "ollama_chat" if chat else "ollama_generate", req)
    if body.stream:
        return streamed(
            [run], _stream(run, body, chat=chat), replies.error_line, media_type=replies.NDJSON
        )
    got = await whole(request, [run])
    if got is None:
        return client_closed()
    a = answer(got[0], _calls(body, run))
    resp = _piece(
        body, chat=chat, text=a.text if not a.calls else a.text.strip(), calls=a.calls,
        logprobs=a.logprobs if body.n_logprobs is not None else None, thinking=a.reasoning,
        done=True, done_reason=_done_reason(a.finish_reason), **_timings(run, a.usage),
    )  # fmt: skip
    return replies.json_response(resp)


async def _stream(
    run: Run, body: o.ChatRequest | o.GenerateRequest, *, chat: bool
) -> AsyncGenerator[bytes, None]:
    enc = msgspec.json.Encoder()
    async for e in events([run], [_calls(body, run)]):
        if isinstance(e, KeepAlive):
            # NDJSON has no comments: an empty piece keeps the connection busy.
            yield enc.encode(_piece(body, chat=chat)) + b"\n"
        elif isinstance(e, Thought):  # thoughts stream first, as Ollama's do
            yield enc.encode(_piece(body, chat=chat, thinking=e.text)) + b"\n"
        elif isinstance(e, Text):
            lp = e.logprobs if body.n_logprobs is not None else None
            if e.text or lp:
                yield enc.encode(_piece(body, chat=chat, text=e.text, logprobs=lp)) + b"\n"
        elif isinstance(e, Called):
            yield enc.encode(_piece(body, chat=chat, calls=[e.call])) + b"\n"
        elif isinstance(e, Finished):
            last = _piece(
                body, chat=chat, done=True, done_reason=_done_reason(e.reason),
                **_timings(run, e.usage),
            )  # fmt: skip
            yield enc.encode(last) + b"\n"


# ---------------------------------------------------------------------------------------
# models


async def not_supported(request: Request) -> Response:
    """Ollama's routes for its own model store (create, copy, push, blobs)."""
    raise ApiError(
        400,
        f"{request.url.path} is not supported by meshd: models are files on the nodes "
        "(see docs/operations.md); place one with POST /api/pull or meshctl place",
        type="invalid_request_error",
        code="not_supported",
    )

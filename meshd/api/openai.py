"""OpenAI-compatible routes: chat completions, completions, models.

A thin adapter: the body is parsed into a :class:`~.runs.GenerateRequest`, the request
runs through :mod:`meshd.api.runs`, and the chunks come back in OpenAI's shapes,
streamed as SSE or collected. Errors before the first byte are HTTP errors in OpenAI's
shape; errors after it are an SSE error event followed by ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from meshd.domain.chat import ChatTurn, ToolCallTurn, ToolSpec, ToolUse
from meshd.domain.sampling import SamplingChoice
from meshd.models import canonical_name
from meshd.transport import wire

from . import schemas
from .answers import (
    Answer,
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
from .errors import model_not_found
from .logprobs import chat_logprobs, completion_logprobs
from .runs import GenerateRequest, Run, admit_choices
from .services import context
from .sse import SSE_DONE, SSE_HEADERS, SSE_KEEPALIVE, SSE_MEDIA_TYPE, sse_data, sse_error
from .toolcalls import Call, ChoiceCalls

__all__ = ["chat_completions", "completions", "list_models", "retrieve_model"]

_Body = schemas.ChatCompletionRequest | schemas.CompletionRequest


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    body = await parse_body(request, schemas.ChatCompletionRequest)
    turns = [_turn(m) for m in body.messages]
    return await _serve(request, body, _generate_request(body, messages=turns), "chat")


def _turn(m: schemas.ChatMessage) -> ChatTurn:
    calls = [ToolCallTurn(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()]
    thoughts = m.reasoning_content or m.reasoning
    return ChatTurn(m.role, m.text, calls, m.tool_call_id, m.name, thoughts, m.images)


def _tool_use(body: _Body) -> ToolUse | None:
    if not isinstance(body, schemas.ChatCompletionRequest) or body.tool_mode is None:
        return None
    tools = [
        ToolSpec(name=t.function.name, description=t.function.description,
                      parameters=t.function.parameters)
        for t in body.tools or ()
    ]  # fmt: skip
    return ToolUse(tools=tools, choice=body.tool_mode)


def _calls(body: _Body, run: Run) -> ChoiceCalls | None:
    """The tool-call reader of one choice (None: the request offers no tools)."""
    if not isinstance(body, schemas.ChatCompletionRequest) or body.tool_mode is None:
        return None
    return ChoiceCalls(
        run.tool_format, parallel=body.parallel_tool_calls is not False, tools=run.tools
    )


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


async def retrieve_model(request: Request) -> Response:
    """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``): one model the cluster
    can serve, or a 404 that lists those it can. An id may hold ``/`` and ``:``
    (``org/repo``, ``name:tag``), so the route takes the rest of the path."""
    name = request.path_params["model_id"]
    view = context(request).services.view()
    if not view.is_known(name):
        raise model_not_found(name, view.known_models())
    return Response(
        msgspec.json.encode(schemas.Model(id=canonical_name(name))), media_type="application/json"
    )


def _generate_request(
    body: _Body, *, messages: list[ChatTurn] | None = None, prompt: str | None = None
) -> GenerateRequest:
    return GenerateRequest(
        model=body.model,
        messages=messages,
        prompt=prompt,
        max_tokens=body.max_new_tokens,
        sampling=SamplingChoice(
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
        cache_prompt=body.cache_prompt,
        speculate=body.speculate,
        exact=body.exact,
        logprobs=body.n_logprobs,
        grammar=body.response_format.grammar
        if isinstance(body, schemas.ChatCompletionRequest) and body.response_format
        else None,
        tools=_tool_use(body),
        **_thinking(body),
    )


def _thinking(body: _Body) -> dict[str, Any]:
    """How a chat request wants the model to think (text completions render no
    template: their prompt is the model's input as it is)."""
    if not isinstance(body, schemas.ChatCompletionRequest):
        return {}
    return {"think": body.think, "template_kwargs": dict(body.chat_template_kwargs or {})}


async def _serve(request: Request, body: _Body, req: GenerateRequest, route: str) -> Response:
    runs = await admit_choices(context(request), route, req, body.n or 1)
    chat = route == "chat"
    if body.stream:
        return streamed(
            runs, _stream(runs, body, chat=chat), lambda e: sse_error(e) + SSE_DONE,
            media_type=SSE_MEDIA_TYPE, headers=dict(SSE_HEADERS),
        )  # fmt: skip
    answers = await whole(request, runs)
    if answers is None:
        return client_closed()
    # The prompt is read once whatever the number of choices (as OpenAI counts it).
    u = schemas.Usage.of(
        answers[0].usage.prompt_tokens,
        sum(a.usage.completion_tokens for a in answers),
        answers[0].usage.cached_tokens,
        sum(a.usage.reasoning_tokens for a in answers),
    )
    n_top = body.n_logprobs
    resp: msgspec.Struct
    if chat:
        resp = schemas.ChatCompletion(
            model=body.model, usage=u,
            choices=[
                schemas.ChatCompletionChoice(
                    index=i, message=_message(a), finish_reason=_reason(a.finish_reason),
                    logprobs=None if n_top is None else chat_logprobs(a.logprobs),
                )
                for i, (c, run) in enumerate(zip(answers, runs, strict=True))
                for a in [answer(c, _calls(body, run))]
            ],
        )  # fmt: skip
    else:
        offset = len(body.prompt_text)  # type: ignore[union-attr]  # a CompletionRequest
        resp = schemas.Completion(
            model=body.model, usage=u,
            choices=[
                schemas.CompletionChoice(
                    index=i, text=a.text, finish_reason=_reason(a.finish_reason),
                    logprobs=None if n_top is None
                    else completion_logprobs(a.logprobs, offset, n_top),
                )
                for i, a in enumerate(answers)
            ],
        )  # fmt: skip
    return Response(msgspec.json.encode(resp), media_type="application/json")


def _reason(finish_reason: str) -> schemas.FinishReason:
    """A choice's finish reason as OpenAI names it: the runner ends one with ``stop``
    or ``length``, and ``answers`` makes ``tool_calls`` of a stop after calls."""
    return cast(schemas.FinishReason, finish_reason)


def _tool_call(call: Call) -> schemas.ToolCall:
    return schemas.ToolCall(
        id=call.id, function=schemas.FunctionCall(name=call.name, arguments=call.arguments)
    )


def _message(a: Answer) -> schemas.AssistantMessage:
    """A whole answer's message, its thoughts and tool calls apart."""
    thoughts = a.reasoning or msgspec.UNSET
    if not a.calls:
        return schemas.AssistantMessage(
            content=a.text, reasoning_content=thoughts, reasoning=thoughts
        )
    return schemas.AssistantMessage(
        content=a.text.strip() or None, tool_calls=[_tool_call(c) for c in a.calls],
        reasoning_content=thoughts, reasoning=thoughts,
    )  # fmt: skip


async def _stream(runs: list[Run], body: _Body, *, chat: bool) -> AsyncGenerator[bytes, None]:
    s = schemas.ChatStream(body.model) if chat else schemas.CompletionStream(body.model)
    n_top = body.n_logprobs
    # Completions: where each choice's next token starts in prompt + answer.
    prompt = 0 if chat else len(body.prompt_text)  # type: ignore[union-attr]  # CompletionRequest
    offset = [prompt] * len(runs)
    if chat:
        assert isinstance(s, schemas.ChatStream)
        for i in range(len(runs)):
            yield sse_data(s.start(i))
    usages: dict[int, wire.Usage] = {}
    async for e in events(runs, [_calls(body, run) for run in runs]):
        if isinstance(e, KeepAlive):
            # The pipeline broke and the request waits for its repair.
            yield SSE_KEEPALIVE
        elif isinstance(e, Thought):
            if chat:
                assert isinstance(s, schemas.ChatStream)
                yield sse_data(s.reasoning(e.text, index=e.choice))
        elif isinstance(e, Text):
            if n_top is None or not e.logprobs:
                yield sse_data(s.content(e.text, index=e.choice))
            elif chat:
                assert isinstance(s, schemas.ChatStream)
                yield sse_data(s.content(e.text, chat_logprobs(e.logprobs), index=e.choice))
            else:
                assert isinstance(s, schemas.CompletionStream)
                lp = completion_logprobs(e.logprobs, offset[e.choice], n_top)
                offset[e.choice] += sum(len(t) for t in lp.tokens)
                yield sse_data(s.content(e.text, lp, index=e.choice))
        elif isinstance(e, Called):
            assert isinstance(s, schemas.ChatStream)
            for chunk in s.tool_call(_tool_call(e.call), e.n, index=e.choice):
                yield sse_data(chunk)
        elif isinstance(e, Finished):
            usages[e.choice] = e.usage
            yield sse_data(s.finish(_reason(e.reason), index=e.choice))
    if body.include_usage and usages:
        first = next(iter(usages.values()))
        total = sum(u.completion_tokens for u in usages.values())
        thought = sum(u.reasoning_tokens for u in usages.values())
        u = schemas.Usage.of(first.prompt_tokens, total, first.cached_tokens, thought)
        yield sse_data(s.usage(u))
    yield SSE_DONE

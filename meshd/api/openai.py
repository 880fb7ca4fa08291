"""OpenAI-compatible routes: chat completions, completions, models.

A thin adapter: the body is parsed into a :class:`~.runs.GenerateRequest`, the request
runs through :mod:`meshd.api.runs`, and the chunks come back in OpenAI's shapes,
streamed as SSE or collected. Errors before the first byte are HTTP errors in OpenAI's
shape; errors after it are an SSE error event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
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
from .logprobs import chat_logprobs, completion_logprobs
from .runs import Collected, GenerateRequest, Run, admit_choices, collect_all_unless_gone
from .sampling import SamplingRequest
from .services import context
from .sse import SSE_DONE, SSE_KEEPALIVE, sse_data, sse_error, sse_response
from .toolcalls import ChoiceCalls

__all__ = ["chat_completions", "completions", "list_models"]

_Body = schemas.ChatCompletionRequest | schemas.CompletionRequest


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    body = await parse_body(request, schemas.ChatCompletionRequest)
    turns = [_turn(m) for m in body.messages]
    return await _serve(request, body, _generate_request(body, messages=turns), "chat")


def _turn(m: schemas.ChatMessage) -> wire.ChatTurn:
    calls = [
        wire.ToolCallTurn(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()
    ]
    return wire.ChatTurn(m.role, m.text, calls, m.tool_call_id, m.name)


def _tool_use(body: _Body) -> wire.ToolUse | None:
    if not isinstance(body, schemas.ChatCompletionRequest) or body.tool_mode is None:
        return None
    tools = [
        wire.ToolSpec(name=t.function.name, description=t.function.description,
                      parameters=t.function.parameters)
        for t in body.tools or ()
    ]  # fmt: skip
    return wire.ToolUse(tools=tools, choice=body.tool_mode)


def _calls(body: _Body, run: Run) -> ChoiceCalls | None:
    """The tool-call reader of one choice (None: the request offers no tools)."""
    if not isinstance(body, schemas.ChatCompletionRequest) or body.tool_mode is None:
        return None
    return ChoiceCalls(run.tool_format, parallel=body.parallel_tool_calls is not False)


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
        logprobs=body.n_logprobs,
        grammar=body.response_format.grammar
        if isinstance(body, schemas.ChatCompletionRequest) and body.response_format
        else None,
        tools=_tool_use(body),
    )


async def _serve(request: Request, body: _Body, req: GenerateRequest, route: str) -> Response:
    runs = await admit_choices(context(request), route, req, body.n or 1)
    if body.stream:
        events = _stream(runs, body, chat=route == "chat")
        # Backstop: a stream the server never starts (client gone before the first
        # byte) never runs its finally; its slots come back when it is freed.
        for run in runs:
            weakref.finalize(events, run.ticket.release)
        return sse_response(events)
    try:
        return await _whole(request, runs, body, chat=route == "chat")
    finally:
        for run in runs:
            await run.close()


def _count(runs: list[Run], outcome: str) -> None:
    for run in runs:
        run.count(outcome)


async def _whole(request: Request, runs: list[Run], body: _Body, *, chat: bool) -> Response:
    try:
        answers = await collect_all_unless_gone(runs, request)
    except RequestFailed as e:
        _count(runs, str(e.status))
        raise request_failed(e) from None
    if answers is None:
        _count(runs, "client_closed")
        return Response(status_code=499)
    _count(runs, "200")
    # The prompt is read once whatever the number of choices (as OpenAI counts it).
    u = schemas.Usage.of(
        answers[0].usage.prompt_tokens, sum(a.usage.completion_tokens for a in answers)
    )
    n_top = body.n_logprobs
    resp: msgspec.Struct
    if chat:
        resp = schemas.ChatCompletion(
            model=body.model, usage=u,
            choices=[
                schemas.ChatCompletionChoice(
                    index=i, message=message, finish_reason=finish,  # type: ignore[arg-type]
                    logprobs=None if n_top is None else chat_logprobs(a.logprobs),
                )
                for i, (a, run) in enumerate(zip(answers, runs, strict=True))
                for message, finish in [_message(a, _calls(body, run))]
            ],
        )  # fmt: skip
    else:
        offset = len(body.prompt_text)  # type: ignore[union-attr]
        resp = schemas.Completion(
            model=body.model, usage=u,
            choices=[
                schemas.CompletionChoice(
                    index=i, text=a.text, finish_reason=a.finish_reason,  # type: ignore[arg-type]
                    logprobs=None if n_top is None
                    else completion_logprobs(a.logprobs, offset, n_top),
                )
                for i, a in enumerate(answers)
            ],
        )  # fmt: skip
    return Response(msgspec.json.encode(resp), media_type="application/json")


def _message(a: Collected, calls: ChoiceCalls | None) -> tuple[schemas.AssistantMessage, str]:
    """A whole answer's message and finish reason, its tool calls read out."""
    if calls is None:
        return schemas.AssistantMessage(content=a.text), a.finish_reason
    head, _ = calls.feed(a.text)
    tail, _ = calls.finish()
    if not calls.calls:
        return schemas.AssistantMessage(content=head + tail), a.finish_reason
    content = (head + tail).strip() or None
    finish = "tool_calls" if a.finish_reason == "stop" else a.finish_reason
    return schemas.AssistantMessage(content=content, tool_calls=calls.calls), finish


async def _merged(runs: list[Run]) -> AsyncIterator[tuple[int, wire.DataChunk | object]]:
    """Every run's chunks as they come, tagged with the choice's index (one run: read
    directly, with no queue in the way of each token)."""
    if len(runs) == 1:
        async with contextlib.aclosing(runs[0].pieces()) as it:
            async for c in it:
                yield 0, c
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    done = object()

    async def pump(i: int, run: Run) -> None:
        try:
            async with contextlib.aclosing(run.pieces()) as it:
                async for c in it:
                    await queue.put((i, c))
        except RequestFailed as e:
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, c = await queue.get()
            if c is done:
                left -= 1
            elif isinstance(c, RequestFailed):
                raise c
            else:
                yield i, c
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _tool_events(
    s: schemas.ChatStream, reader: ChoiceCalls, c: wire.DataChunk, i: int
) -> list[bytes]:
    """The events of one chunk of a choice whose calls are read out: content as the
    reader lets it through, each call as a name chunk then an arguments chunk."""
    text, new = reader.feed(c.text)
    if c.finish_reason:
        rest, more = reader.finish()
        text, new = text + rest, new + more
    out: list[bytes] = []
    if text or c.logprobs:
        out.append(sse_data(s.content(text, chat_logprobs(c.logprobs) if c.logprobs else None,
                                      index=i)))  # fmt: skip
    for call in new:
        n = reader.calls.index(call)
        out += [sse_data(chunk) for chunk in s.tool_call(call, n, index=i)]
    if c.finish_reason:
        reason = "tool_calls" if reader.calls and c.finish_reason == "stop" else c.finish_reason
        out.append(sse_data(s.finish(reason, index=i)))  # type: ignore[arg-type]
    return out


async def _stream(runs: list[Run], body: _Body, *, chat: bool) -> AsyncIterator[bytes]:
    s = schemas.ChatStream(body.model) if chat else schemas.CompletionStream(body.model)
    n_top = body.n_logprobs
    # Completions: where each choice's next token starts in prompt + answer.
    offset = [0 if chat else len(body.prompt_text)] * len(runs)  # type: ignore[union-attr]
    outcome = "200"
    calls = [_calls(body, run) for run in runs]
    try:
        if chat:
            for i in range(len(runs)):
                yield sse_data(s.start(i))
        usages: dict[int, wire.Usage] = {}
        async for i, c in _merged(runs):
            if c is KEEPALIVE:
                # The pipeline broke and the request waits for its repair.
                yield SSE_KEEPALIVE
                continue
            assert isinstance(c, wire.DataChunk)
            if c.finish_reason and c.usage is not None:
                usages[i] = c.usage
            reader = calls[i]
            if reader is not None:
                assert isinstance(s, schemas.ChatStream)
                for event in _tool_events(s, reader, c, i):
                    yield event
                continue
            if n_top is not None and c.logprobs:
                # Tokens whose text is held back (a possible stop string) still
                # report their log-probabilities, in the chunk that made them.
                if chat:
                    yield sse_data(s.content(c.text, chat_logprobs(c.logprobs), index=i))
                else:
                    lp = completion_logprobs(c.logprobs, offset[i], n_top)
                    offset[i] += sum(len(t) for t in lp.tokens)
                    yield sse_data(s.content(c.text, lp, index=i))
            elif c.text:
                yield sse_data(s.content(c.text, index=i))
            if c.finish_reason:
                yield sse_data(s.finish(c.finish_reason, index=i))  # type: ignore[arg-type]
        if body.include_usage and usages:
            prompt = next(iter(usages.values())).prompt_tokens
            total = sum(u.completion_tokens for u in usages.values())
            yield sse_data(s.usage(schemas.Usage.of(prompt, total)))
        yield SSE_DONE
    except RequestFailed as e:
        outcome = str(e.status)
        yield sse_error(request_failed(e))
        yield SSE_DONE
    finally:
        for run in runs:
            await run.close()
        _count(runs, outcome)

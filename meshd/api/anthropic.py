"""Anthropic Messages on the node's own port: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``; a thin adapter like :mod:`.openai`.

A conversation becomes the one :class:`~.runs.GenerateRequest`: the system prompt a
system turn, ``tool_use`` blocks the assistant's calls, ``tool_result`` blocks tool
turns. Answers come from :mod:`.answers`: whole, as a message of ``text`` and
``tool_use`` blocks (after a ``thinking`` block where the model thought), or streamed
with Anthropic's events (``message_start``, ``ping``,
``content_block_start/delta/stop``, ``message_delta``, ``message_stop``; ``ping``
again while a broken pipeline is repaired; ``error`` on a failure mid-stream).

Claude Code (2.1.36 and later) puts a per-request nonce in its first system block,
on a line starting ``x-anthropic-``: such lines are dropped, so the prompt of every
turn starts alike (a prefix cache can reuse it) and no nonce reaches the model.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from meshd.domain.chat import IMAGE_MARKER, ChatTurn, ToolCallTurn, ToolSpec, ToolUse, image_text
from meshd.domain.reasoning import ThinkChoice
from meshd.domain.sampling import SamplingChoice
from meshd.transport import wire

from . import anthropic_schemas as a
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
from .runs import GenerateRequest, Run, admit
from .services import context
from .sse import SSE_HEADERS, SSE_MEDIA_TYPE
from .toolcalls import ChoiceCalls, json_text

__all__ = ["count_tokens", "messages", "system_prompt"]


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def system_prompt(text: str) -> str:
    """``text`` without the ``x-anthropic-...`` lines clients add per request."""
    if "x-anthropic-" not in text:
        return text
    lines = text.splitlines(keepends=True)
    return "".join(ln for ln in lines if not ln.lstrip().startswith("x-anthropic-")).strip()


def _turns(body: a.MessagesRequest | a.CountTokensRequest) -> list[ChatTurn]:
    """The conversation as chat turns."""
    turns: list[ChatTurn] = []
    system = system_prompt(body.system_text)
    if system:
        turns.append(ChatTurn("system", system))
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for its result
    for m in body.messages:
        if isinstance(m.content, str):
            turns.append(ChatTurn(m.role, image_text(m.content)))
            continue
        text = "\n".join(
            IMAGE_MARKER if b.type == "image" else image_text(b.text or "")
            for b in m.content
            if b.type in ("text", "image")
        )
        images = [b.source.image for b in m.content if b.type == "image" and b.source]
        if m.role == "assistant":
            calls = [
                ToolCallTurn(b.id or "", b.name or "", json_text(b.input or {}))
                for b in m.content
                if b.type == "tool_use"
            ]
            for c in calls:
                names[c.id] = c.name
            thoughts = "\n".join(b.thinking or "" for b in m.content if b.type == "thinking")
            turns.append(
                ChatTurn("assistant", text, calls, reasoning=thoughts or None, images=images)
            )
            continue
        # Results first: they answer the calls of the assistant turn just before.
        for b in m.content:
            if b.type == "tool_result":
                out = b.result_text
                if b.is_error:
                    out = f"Error: {out}"
                tid = b.tool_use_id or ""
                turns.append(ChatTurn("tool", out, [], tid, names.get(tid)))
        if text or not any(b.type == "tool_result" for b in m.content):
            turns.append(ChatTurn("user", text, images=images))
    return turns


def _tool_use(body: a.MessagesRequest | a.CountTokensRequest) -> ToolUse | None:
    mode = body.tool_mode
    if mode is None:
        return None
    tools = [
        ToolSpec(name=t.name, description=t.description, parameters=t.input_schema)
        for t in body.tools or ()
    ]
    return ToolUse(tools=tools, choice=mode)


def _calls(body: a.MessagesRequest, run: Run) -> ChoiceCalls | None:
    if body.tool_mode is None:
        return None
    c = body.tool_choice
    parallel = not (c is not None and c.disable_parallel_tool_use)
    return ChoiceCalls(run.tool_format, parallel=parallel, new_id=_tool_use_id, tools=run.tools)


#: The signature of every thinking block: Anthropic signs its models' thoughts so that
#: a client cannot forge them; a local model's thoughts carry no proof (and those sent
#: back are not checked).
SIGNATURE = "meshd-local"


def _shows_thoughts(body: a.MessagesRequest) -> bool:
    """Whether thinking blocks carry the thoughts (``display: omitted``: empty)."""
    return body.thinking is None or body.thinking.display != "omitted"


def _stop_reason(reason: str, stop_sequence: str | None) -> str:
    if reason == "tool_calls":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence else "end_turn"


async def messages(request: Request) -> Response:
    """``POST /v1/messages``."""
    body = await parse_body(request, a.MessagesRequest)
    req = GenerateRequest(
        model=body.model,
        messages=_turns(body),
        max_tokens=body.max_tokens,
        sampling=SamplingChoice(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k),
        stop=list(body.stop_sequences or []),
        grammar=body.grammar,
        tools=_tool_use(body),
        think=body.thinking.choice if body.thinking is not None else ThinkChoice(),
        exact=body.exact,
    )
    run = await admit(context(request), "messages", req)
    if body.stream:
        return streamed(
            [run], _stream(run, body), _error_event,
            media_type=SSE_MEDIA_TYPE, headers=dict(SSE_HEADERS),
        )  # fmt: skip
    got = await whole(request, [run])
    if got is None:
        return client_closed()
    ans = answer(got[0], _calls(body, run))
    blocks: list[a.ResponseBlock] = []
    if ans.reasoning:
        shown = ans.reasoning if _shows_thoughts(body) else ""
        blocks.append(a.ResponseBlock(type="thinking", thinking=shown, signature=SIGNATURE))
    text = ans.text.strip() if ans.calls else ans.text
    if text or not ans.calls:
        blocks.append(a.ResponseBlock(type="text", text=text))
    blocks += [
        a.ResponseBlock(type="tool_use", id=c.id, name=c.name, input=c.arguments_object())
        for c in ans.calls
    ]
    msg = a.Message(
        id=_message_id(), model=body.model, content=blocks,
        stop_reason=_stop_reason(ans.finish_reason, ans.stop_sequence),
        stop_sequence=ans.stop_sequence,
        usage=_usage(ans.usage),
    )  # fmt: skip
    return Response(msgspec.json.encode(msg), media_type="application/json")


_enc = msgspec.json.Encoder()


def _event(kind: str, data: object) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _enc.encode(data) + b"\n\n"


_PING = _event("ping", {"type": "ping"})


def _error_event(err: ApiError) -> bytes:
    return _event("error", err.body_in("anthropic"))


def _usage(u: wire.Usage) -> a.Usage:
    """Anthropic's counts: tokens read from the prefix cache are apart from the
    input tokens computed (the client adds them up for the context's size)."""
    return a.Usage(
        input_tokens=u.prompt_tokens - u.cached_tokens,
        output_tokens=u.completion_tokens,
        cache_read_input_tokens=u.cached_tokens,
    )


async def _stream(run: Run, body: a.MessagesRequest) -> AsyncGenerator[bytes, None]:
    start = a.Message(
        id=_message_id(), model=body.model, content=[], stop_reason=None, stop_sequence=None,
        usage=_usage(wire.Usage(run.n_prompt, 0, run.n_cached)),
    )  # fmt: skip
    yield _event("message_start", {"type": "message_start", "message": start})
    yield _PING
    index = -1  # the block being written
    in_text = in_thought = False  # that block is a text block, a thinking block
    shown = _shows_thoughts(body)

    def close() -> bytes:
        out = b""
        if in_thought:  # a thinking block's signature comes last, as Anthropic's does
            out = _event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": SIGNATURE},
            })  # fmt: skip
        return out + _event("content_block_stop", {"type": "content_block_stop", "index": index})

    async for e in events([run], [_calls(body, run)]):
        if isinstance(e, KeepAlive):
            yield _PING
        elif isinstance(e, Thought):
            if not in_thought:
                if index >= 0:
                    yield close()
                index, in_text, in_thought = index + 1, False, True
                yield _event("content_block_start", {
                    "type": "content_block_start", "index": index,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                })  # fmt: skip
            if shown:
                yield _event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "thinking_delta", "thinking": e.text},
                })  # fmt: skip
        elif isinstance(e, Text) and e.text:
            if not in_text:
                if index >= 0:
                    yield close()
                index, in_text, in_thought = index + 1, True, False
                yield _event("content_block_start", {
                    "type": "content_block_start", "index": index,
                    "content_block": {"type": "text", "text": ""},
                })  # fmt: skip
            yield _event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "text_delta", "text": e.text},
            })  # fmt: skip
        elif isinstance(e, Called):
            if index >= 0:
                yield close()
            index, in_text, in_thought = index + 1, False, False
            c = e.call
            yield _event("content_block_start", {
                "type": "content_block_start", "index": index,
                "content_block": {"type": "tool_use", "id": c.id, "name": c.name, "input": {}},
            })  # fmt: skip
            yield _event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": c.arguments},
            })  # fmt: skip
        elif isinstance(e, Finished):
            if index >= 0:
                yield close()
            yield _event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(e.reason, e.stop_sequence),
                          "stop_sequence": e.stop_sequence},
                "usage": {"output_tokens": e.usage.completion_tokens},
            })  # fmt: skip
            yield _event("message_stop", {"type": "message_stop"})


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as the model reads it
    (its chat template, tools included), counted by stage 0 without running it."""
    body = await parse_body(request, a.CountTokensRequest)
    think = body.thinking.choice if body.thinking is not None else ThinkChoice()
    req = GenerateRequest(
        model=body.model, messages=_turns(body), tools=_tool_use(body), count_only=True,
        think=think,
    )  # fmt: skip
    run = await admit(context(request), "count_tokens", req)
    got = await whole(request, [run])
    if got is None:
        return client_closed()
    return Response(
        msgspec.json.encode({"input_tokens": got[0].usage.prompt_tokens}),
        media_type="application/json",
    )

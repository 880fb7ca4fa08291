"""OpenAI's Responses API, ``POST /v1/responses``: a thin adapter, as chat completions.

The body (:class:`~.responses_schemas.ResponseRequest`) is parsed into a
:class:`~.runs.GenerateRequest` (``input`` as chat turns, ``tools`` as
:class:`~meshd.transport.ToolUse`, ``text.format`` as a grammar), one run is
admitted, and what it gives back (:mod:`meshd.api.answers`) is rendered as a response
object, or streamed as the Responses events (``event: <type>`` then ``data: <json>``,
every event numbered).

meshd keeps no response on the server: ``previous_response_id`` and ``conversation``
are 400s (see :class:`~.responses_schemas.ResponseRequest`); the client sends the whole
conversation in ``input``, as it does for chat completions.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from meshd.domain.chat import ChatTurn, ToolCallTurn, ToolSpec, ToolUse, image_text
from meshd.domain.sampling import SamplingChoice

from . import responses_schemas as rs
from .answers import (
    Answer,
    answer,
    client_closed,
    streamed,
    whole,
)
from .bodies import parse_body
from .responses_stream import Draft, Stream, call_item, status
from .runs import GenerateRequest, Run, admit_choices
from .services import context
from .sse import SSE_HEADERS, SSE_MEDIA_TYPE
from .toolcalls import ChoiceCalls

__all__ = ["create_response", "generate_request", "turns"]

_encoder = msgspec.json.Encoder()


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``: a response object, or (``stream``) its events."""
    body = await parse_body(request, rs.ResponseRequest)
    runs = await admit_choices(context(request), "responses", generate_request(body), 1)
    draft = Draft(body)
    if body.stream:
        s = Stream(draft)
        return streamed(
            runs, s.render(runs, _calls(body, runs[0])), s.error,
            media_type=SSE_MEDIA_TYPE, headers=dict(SSE_HEADERS),
        )  # fmt: skip
    got = await whole(request, runs)
    if got is None:
        return client_closed()
    a = answer(got[0], _calls(body, runs[0]))
    resp = draft.final(_output(a), a.finish_reason, a.usage)
    return Response(_encoder.encode(resp), media_type="application/json")


def generate_request(body: rs.ResponseRequest) -> GenerateRequest:
    """The request in no dialect: ``instructions`` and ``input`` as chat turns."""
    fmt = body.text.format if body.text is not None else None
    return GenerateRequest(
        model=body.model,
        messages=turns(body),
        max_tokens=body.max_output_tokens,
        max_tokens_param="max_output_tokens",
        sampling=SamplingChoice(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repeat_penalty=body.repeat_penalty,
            repeat_last_n=body.repeat_last_n,
            seed=body.seed,
        ),
        grammar=fmt.grammar if fmt is not None else None,
        tools=_tool_use(body),
        think=body.think,
        exact=body.exact,
    )


def turns(body: rs.ResponseRequest) -> list[ChatTurn]:
    """``instructions`` (a system turn) and ``input`` as the chat turns stage 0 renders.

    A ``function_call`` item joins the assistant turn just before it (an assistant turn
    with calls, as chat completions carry it); a ``function_call_output`` is a ``tool``
    turn, named after the function it answers (some templates show the name). A
    ``reasoning`` item's thoughts go with the assistant turn that follows it.
    """
    out: list[ChatTurn] = []
    if body.instructions is not None:
        out.append(ChatTurn("system", body.instructions))
    if isinstance(body.input, str):
        out.append(ChatTurn("user", image_text(body.input)))
        return out
    names: dict[str, str] = {}
    thoughts = None  # a reasoning item's, for the assistant turn after it
    for item in body.input:
        if item.type == "message":
            # Open models' templates know "system", not OpenAI's newer "developer",
            # which means the same: instructions from the application.
            role = "system" if item.role == "developer" else item.role
            assert role is not None  # checked on decode
            mine = thoughts if role == "assistant" else None
            out.append(ChatTurn(role, item.text, reasoning=mine, images=item.images))
            thoughts = None if role == "assistant" else thoughts
        elif item.type == "function_call":
            assert item.call_id is not None and item.name is not None
            call = ToolCallTurn(item.call_id, item.name, item.arguments or "{}")
            names[item.call_id] = item.name
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and thoughts is None:
                out[-1] = msgspec.structs.replace(last, tool_calls=[*last.tool_calls, call])
            else:
                out.append(ChatTurn("assistant", "", [call], reasoning=thoughts))
            thoughts = None
        elif item.type == "function_call_output":
            assert item.call_id is not None
            out.append(ChatTurn("tool", item.text, [], item.call_id, names.get(item.call_id)))
        elif item.type == "reasoning":
            thoughts = item.thoughts or None
    return out


def _tool_use(body: rs.ResponseRequest) -> ToolUse | None:
    mode = body.tool_mode
    if mode is None:
        return None
    tools = [
        ToolSpec(name=t.name or "", description=t.description, parameters=t.parameters)
        for t in body.tools or ()
    ]
    return ToolUse(tools=tools, choice=mode)


def _calls(body: rs.ResponseRequest, run: Run) -> ChoiceCalls | None:
    """The tool-call reader of the answer (None: the request offers no tools)."""
    if body.tool_mode is None:
        return None
    return ChoiceCalls(
        run.tool_format, parallel=body.parallel_tool_calls is not False, tools=run.tools
    )


def _output(a: Answer) -> list[rs.OutputItem]:
    """A whole answer's output items: its thoughts, its message, then its calls. An
    answer that only calls has no message (the newlines around its calls are no answer)."""
    items: list[rs.OutputItem] = []
    if a.reasoning:
        content = [rs.ReasoningText(text=a.reasoning)]
        items.append(rs.ReasoningItem(id=rs.new_reasoning_id(), content=content))
    if not a.calls or a.text.strip():
        items.append(
            rs.OutputMessage(
                id=rs.new_message_id(), status=status(a.finish_reason),
                content=[rs.OutputText(text=a.text)],
            )
        )  # fmt: skip
    items += [call_item(c) for c in a.calls]
    return items

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

from collections.abc import AsyncGenerator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from meshd.domain.chat import ChatTurn, ToolCallTurn, ToolSpec, ToolUse
from meshd.domain.sampling import SamplingChoice
from meshd.transport import wire

from . import responses_schemas as rs
from .answers import (
    Answer,
    Called,
    Finished,
    KeepAlive,
    Text,
    answer,
    client_closed,
    events,
    streamed,
    whole,
)
from .bodies import parse_body
from .errors import ApiError
from .runs import GenerateRequest, Run, admit_choices
from .schemas import unix_time
from .services import context
from .sse import SSE_HEADERS, SSE_KEEPALIVE, SSE_MEDIA_TYPE
from .toolcalls import Call, ChoiceCalls

__all__ = ["create_response", "generate_request", "turns"]

_encoder = msgspec.json.Encoder()


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``: a response object, or (``stream``) its events."""
    body = await parse_body(request, rs.ResponseRequest)
    runs = await admit_choices(context(request), "responses", generate_request(body), 1)
    draft = _Draft(body)
    if body.stream:
        s = _Stream(draft)
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
    )


def turns(body: rs.ResponseRequest) -> list[ChatTurn]:
    """``instructions`` (a system turn) and ``input`` as the chat turns stage 0 renders.

    A ``function_call`` item joins the assistant turn just before it (an assistant turn
    with calls, as chat completions carry it); a ``function_call_output`` is a ``tool``
    turn, named after the function it answers (some templates show the name).
    """
    out: list[ChatTurn] = []
    if body.instructions is not None:
        out.append(ChatTurn("system", body.instructions))
    if isinstance(body.input, str):
        out.append(ChatTurn("user", body.input))
        return out
    names: dict[str, str] = {}
    for item in body.input:
        if item.type == "message":
            # Open models' templates know "system", not OpenAI's newer "developer",
            # which means the same: instructions from the application.
            role = "system" if item.role == "developer" else item.role
            assert role is not None  # checked on decode
            out.append(ChatTurn(role, item.text))
        elif item.type == "function_call":
            assert item.call_id is not None and item.name is not None
            call = ToolCallTurn(item.call_id, item.name, item.arguments or "{}")
            names[item.call_id] = item.name
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = ChatTurn("assistant", last.content, [*last.tool_calls, call])
            else:
                out.append(ChatTurn("assistant", "", [call]))
        elif item.type == "function_call_output":
            assert item.call_id is not None
            out.append(ChatTurn("tool", item.text, [], item.call_id, names.get(item.call_id)))
        # "reasoning" items: skipped (the models here take no reasoning state back).
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


def _status(finish_reason: str) -> rs.ItemStatus:
    return "incomplete" if finish_reason == "length" else "completed"


def _call_item(call: Call) -> rs.FunctionCallItem:
    return rs.FunctionCallItem(
        id=rs.new_function_call_id(), call_id=call.id, name=call.name,
        arguments=call.arguments, status="completed",
    )  # fmt: skip


def _output(a: Answer) -> list[rs.OutputItem]:
    """A whole answer's output items: its message, then its calls. An answer that only
    calls has no message (the newlines around its calls are no answer)."""
    items: list[rs.OutputItem] = []
    if not a.calls or a.text.strip():
        items.append(
            rs.OutputMessage(
                id=rs.new_message_id(), status=_status(a.finish_reason),
                content=[rs.OutputText(text=a.text)],
            )
        )  # fmt: skip
    items += [_call_item(c) for c in a.calls]
    return items


class _Draft:
    """The response object of one request, at any point of its life (same id, time and
    echoed settings throughout)."""

    def __init__(self, body: rs.ResponseRequest) -> None:
        self.body = body
        self.id = rs.new_response_id()
        self.created_at = unix_time()

    def response(
        self,
        status: rs.ResponseStatus,
        output: list[rs.OutputItem],
        usage: rs.ResponseUsage | None = None,
    ) -> rs.Response:
        """The response as it stands."""
        b = self.body
        return rs.Response(
            id=self.id, created_at=self.created_at, status=status, model=b.model,
            output=output, usage=usage,
            incomplete_details=rs.IncompleteDetails() if status == "incomplete" else None,
            instructions=b.instructions, max_output_tokens=b.max_output_tokens,
            temperature=b.temperature, top_p=b.top_p,
            tool_choice=b.tool_choice or "auto", tools=list(b.tools or ()),
            parallel_tool_calls=b.parallel_tool_calls is not False,
            text=b.text or rs.TextConfig(), metadata=dict(b.metadata or {}),
        )  # fmt: skip

    def final(
        self, output: list[rs.OutputItem], finish_reason: str, usage: wire.Usage
    ) -> rs.Response:
        """The finished response: ``incomplete`` when cut at ``max_output_tokens``."""
        u = rs.ResponseUsage.of(usage.prompt_tokens, usage.completion_tokens)
        return self.response(_status(finish_reason), output, u)


class _Stream:
    """Renders :func:`~.answers.events` as the Responses events of one response.

    The message item opens at the first text that is not blank (an answer that only
    calls has none) and closes before a call item opens; each call is one item, its
    arguments in one delta (calls are read whole).
    """

    def __init__(self, draft: _Draft) -> None:
        self.draft = draft
        self.seq = 0
        #: The output items so far, each as it stands (index: its ``output_index``).
        self.items: list[rs.OutputItem] = []
        #: The open message: its index in ``items`` and its text so far.
        self.msg: int | None = None
        self.text: list[str] = []

    def _n(self) -> int:
        """The next event's ``sequence_number``."""
        self.seq += 1
        return self.seq - 1

    @staticmethod
    def _sse(ev: rs.ResponseEvent) -> bytes:
        tag = type(ev).__struct_config__.tag  # the event's type
        assert isinstance(tag, str)
        return b"event: " + tag.encode() + b"\ndata: " + _encoder.encode(ev) + b"\n\n"

    def error(self, e: ApiError) -> bytes:
        """The event that ends a stream whose run failed (``answers.streamed``'s
        ``on_error``)."""
        code = e.code or e.type
        detail = rs.ErrorEventDetail(type=e.type, code=code, message=e.message, param=e.param)
        return self._sse(
            rs.ErrorEvent(
                sequence_number=self._n(), code=code, message=e.message, param=e.param,
                error=detail,
            )
        )  # fmt: skip

    async def render(
        self, runs: list[Run], reader: ChoiceCalls | None
    ) -> AsyncGenerator[bytes, None]:
        """Every event of the response, from ``response.created`` to its end."""
        started = self.draft.response("in_progress", [])
        yield self._sse(rs.ResponseCreated(sequence_number=self._n(), response=started))
        yield self._sse(rs.ResponseInProgress(sequence_number=self._n(), response=started))
        # Blank text not shown yet: it opens no message on its own.
        blank = ""
        end: Finished | None = None
        async for e in events(runs, [reader]):
            if isinstance(e, KeepAlive):
                # The pipeline broke and the request waits for its repair.
                yield SSE_KEEPALIVE
            elif isinstance(e, Text):
                text = e.text
                if self.msg is None:
                    if not (blank + text).strip():
                        blank += text
                        continue
                    for b in self._open_message():
                        yield b
                    text, blank = blank + text, ""
                if text:
                    yield self._delta(text)
            elif isinstance(e, Called):
                if self.msg is not None:
                    for b in self._close_message("completed"):
                        yield b
                blank = ""  # the newlines before a call are no answer
                for b in self._call(e.call):
                    yield b
            elif isinstance(e, Finished):
                end = e
                if self.msg is None and not self.items:
                    # Nothing but blank text: still a message (whole answers have one).
                    for b in self._open_message():
                        yield b
                    if blank:
                        yield self._delta(blank)
                if self.msg is not None:
                    for b in self._close_message(_status(e.reason)):
                        yield b
        reason = end.reason if end is not None else "stop"
        usage = end.usage if end is not None else wire.Usage(runs[0].n_prompt, 0)
        resp = self.draft.final(list(self.items), reason, usage)
        last = rs.ResponseIncomplete if resp.status == "incomplete" else rs.ResponseCompleted
        yield self._sse(last(sequence_number=self._n(), response=resp))

    def _open_message(self) -> list[bytes]:
        self.msg = len(self.items)
        item = rs.OutputMessage(id=rs.new_message_id(), status="in_progress", content=[])
        self.items.append(item)
        self.text = []
        return [
            self._sse(rs.OutputItemAdded(sequence_number=self._n(), output_index=self.msg,
                                         item=item)),
            self._sse(rs.ContentPartAdded(sequence_number=self._n(), item_id=item.id,
                                          output_index=self.msg, content_index=0,
                                          part=rs.OutputText(text=""))),
        ]  # fmt: skip

    def _delta(self, text: str) -> bytes:
        assert self.msg is not None
        self.text.append(text)
        return self._sse(
            rs.OutputTextDelta(
                sequence_number=self._n(), item_id=self.items[self.msg].id,
                output_index=self.msg, content_index=0, delta=text,
            )
        )  # fmt: skip

    def _close_message(self, status: rs.ItemStatus) -> list[bytes]:
        assert self.msg is not None
        i, self.msg = self.msg, None
        part = rs.OutputText(text="".join(self.text))
        item = rs.OutputMessage(id=self.items[i].id, status=status, content=[part])
        self.items[i] = item
        return [
            self._sse(rs.OutputTextDone(sequence_number=self._n(), item_id=item.id,
                                        output_index=i, content_index=0, text=part.text)),
            self._sse(rs.ContentPartDone(sequence_number=self._n(), item_id=item.id,
                                         output_index=i, content_index=0, part=part)),
            self._sse(rs.OutputItemDone(sequence_number=self._n(), output_index=i, item=item)),
        ]  # fmt: skip

    def _call(self, call: Call) -> list[bytes]:
        i = len(self.items)
        done = _call_item(call)
        # Opened with no arguments yet: they follow as one delta.
        opened = rs.FunctionCallItem(
            id=done.id, call_id=call.id, name=call.name, arguments="", status="in_progress"
        )
        self.items.append(done)
        args = call.arguments
        return [
            self._sse(rs.OutputItemAdded(sequence_number=self._n(), output_index=i, item=opened)),
            self._sse(rs.FunctionCallArgumentsDelta(sequence_number=self._n(), item_id=done.id,
                                                    output_index=i, delta=args)),
            self._sse(rs.FunctionCallArgumentsDone(sequence_number=self._n(), item_id=done.id,
                                                   output_index=i, arguments=args)),
            self._sse(rs.OutputItemDone(sequence_number=self._n(), output_index=i, item=done)),
        ]  # fmt: skip

"""A response of the Responses API as it is rendered: the response object at any
point of its life (:class:`Draft`), and the events of a streamed one (:class:`Stream`)
from what its run gives back (:func:`~.answers.events`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import msgspec

from meshd.transport import wire

from . import responses_events as ev
from . import responses_schemas as rs
from .answers import Called, Finished, KeepAlive, Text, Thought, events
from .errors import ApiError
from .runs import Run
from .schemas import unix_time
from .sse import SSE_KEEPALIVE
from .toolcalls import Call, ChoiceCalls

__all__ = ["Draft", "Stream", "call_item", "status"]

_encoder = msgspec.json.Encoder()


def status(finish_reason: str) -> rs.ItemStatus:
    """An item's status from how its answer ended."""
    return "incomplete" if finish_reason == "length" else "completed"


def call_item(call: Call) -> rs.FunctionCallItem:
    """A call the model made, as an output item."""
    return rs.FunctionCallItem(
        id=rs.new_function_call_id(), call_id=call.id, name=call.name,
        arguments=call.arguments, status="completed",
    )  # fmt: skip


class Draft:
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
        u = rs.ResponseUsage.of(
            usage.prompt_tokens, usage.completion_tokens, usage.reasoning_tokens,
            usage.cached_tokens,
        )  # fmt: skip
        return self.response(status(finish_reason), output, u)


class Stream:
    """Renders :func:`~.answers.events` as the Responses events of one response.

    A reasoning item opens at the first thoughts and closes before the answer's
    items. The message item opens at the first text that is not blank (an answer that
    only calls has none) and closes before a call item opens; each call is one item,
    its arguments in one delta (calls are read whole).
    """

    def __init__(self, draft: Draft) -> None:
        self.draft = draft
        self.seq = 0
        #: The output items so far, each as it stands (index: its ``output_index``).
        self.items: list[rs.OutputItem] = []
        #: The open message: its index in ``items`` and its text so far.
        self.msg: int | None = None
        self.text: list[str] = []
        #: The open reasoning item: its index in ``items`` and its thoughts so far.
        self.thought: int | None = None
        self.thoughts: list[str] = []

    def _n(self) -> int:
        """The next event's ``sequence_number``."""
        self.seq += 1
        return self.seq - 1

    @staticmethod
    def _sse(event: ev.ResponseEvent) -> bytes:
        tag = type(event).__struct_config__.tag  # the event's type
        assert isinstance(tag, str)
        return b"event: " + tag.encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n"

    def error(self, e: ApiError) -> bytes:
        """The event that ends a stream whose run failed (``answers.streamed``'s
        ``on_error``)."""
        code = e.code or e.type
        detail = ev.ErrorEventDetail(type=e.type, code=code, message=e.message, param=e.param)
        return self._sse(
            ev.ErrorEvent(
                sequence_number=self._n(), code=code, message=e.message, param=e.param,
                error=detail,
            )
        )  # fmt: skip

    async def render(
        self, runs: list[Run], reader: ChoiceCalls | None
    ) -> AsyncGenerator[bytes, None]:
        """Every event of the response, from ``response.created`` to its end."""
        started = self.draft.response("in_progress", [])
        yield self._sse(ev.ResponseCreated(sequence_number=self._n(), response=started))
        yield self._sse(ev.ResponseInProgress(sequence_number=self._n(), response=started))
        # Blank text not shown yet: it opens no message on its own.
        blank = ""
        end: Finished | None = None
        async for e in events(runs, [reader]):
            if isinstance(e, KeepAlive):
                # The pipeline broke and the request waits for its repair.
                yield SSE_KEEPALIVE
            elif isinstance(e, Thought):
                for b in self._think(e.text):
                    yield b
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
                for b in self._close_thought(status(e.reason)):
                    yield b
                if self.msg is None and not any(
                    not isinstance(i, rs.ReasoningItem) for i in self.items
                ):
                    # Nothing but blank text: still a message (whole answers have one).
                    for b in self._open_message():
                        yield b
                    if blank:
                        yield self._delta(blank)
                if self.msg is not None:
                    for b in self._close_message(status(e.reason)):
                        yield b
        reason = end.reason if end is not None else "stop"
        usage = end.usage if end is not None else wire.Usage(runs[0].n_prompt, 0)
        resp = self.draft.final(list(self.items), reason, usage)
        last = ev.ResponseIncomplete if resp.status == "incomplete" else ev.ResponseCompleted
        yield self._sse(last(sequence_number=self._n(), response=resp))

    def _think(self, text: str) -> list[bytes]:
        """More thoughts: in the open reasoning item, or one opened for them."""
        out = []
        if self.thought is None:
            if self.msg is not None:
                out += self._close_message("completed")
            self.thought = len(self.items)
            item = rs.ReasoningItem(id=rs.new_reasoning_id(), status="in_progress")
            self.items.append(item)
            self.thoughts = []
            out += [
                self._sse(ev.OutputItemAdded(sequence_number=self._n(), output_index=self.thought,
                                             item=item)),
                self._sse(ev.ContentPartAdded(sequence_number=self._n(), item_id=item.id,
                                              output_index=self.thought, content_index=0,
                                              part=rs.ReasoningText(text=""))),
            ]  # fmt: skip
        self.thoughts.append(text)
        out.append(self._sse(ev.ReasoningTextDelta(
            sequence_number=self._n(), item_id=self.items[self.thought].id,
            output_index=self.thought, content_index=0, delta=text,
        )))  # fmt: skip
        return out

    def _close_thought(self, status: rs.ItemStatus = "completed") -> list[bytes]:
        """The events that complete the open reasoning item (none if none is open)."""
        if self.thought is None:
            return []
        i, self.thought = self.thought, None
        part = rs.ReasoningText(text="".join(self.thoughts))
        item = rs.ReasoningItem(id=self.items[i].id, content=[part], status=status)
        self.items[i] = item
        return [
            self._sse(ev.ReasoningTextDone(sequence_number=self._n(), item_id=item.id,
                                           output_index=i, content_index=0, text=part.text)),
            self._sse(ev.ContentPartDone(sequence_number=self._n(), item_id=item.id,
                                         output_index=i, content_index=0, part=part)),
            self._sse(ev.OutputItemDone(sequence_number=self._n(), output_index=i, item=item)),
        ]  # fmt: skip

    def _open_message(self) -> list[bytes]:
        closed = self._close_thought()
        self.msg = len(self.items)
        item = rs.OutputMessage(id=rs.new_message_id(), status="in_progress", content=[])
        self.items.append(item)
        self.text = []
        return [
            *closed,
            self._sse(ev.OutputItemAdded(sequence_number=self._n(), output_index=self.msg,
                                         item=item)),
            self._sse(ev.ContentPartAdded(sequence_number=self._n(), item_id=item.id,
                                          output_index=self.msg, content_index=0,
                                          part=rs.OutputText(text=""))),
        ]  # fmt: skip

    def _delta(self, text: str) -> bytes:
        assert self.msg is not None
        self.text.append(text)
        return self._sse(
            ev.OutputTextDelta(
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
            self._sse(ev.OutputTextDone(sequence_number=self._n(), item_id=item.id,
                                        output_index=i, content_index=0, text=part.text)),
            self._sse(ev.ContentPartDone(sequence_number=self._n(), item_id=item.id,
                                         output_index=i, content_index=0, part=part)),
            self._sse(ev.OutputItemDone(sequence_number=self._n(), output_index=i, item=item)),
        ]  # fmt: skip

    def _call(self, call: Call) -> list[bytes]:
        closed = self._close_thought()
        i = len(self.items)
        done = call_item(call)
        # Opened with no arguments yet: they follow as one delta.
        opened = rs.FunctionCallItem(
            id=done.id, call_id=call.id, name=call.name, arguments="", status="in_progress"
        )
        self.items.append(done)
        args = call.arguments
        return [
            *closed,
            self._sse(ev.OutputItemAdded(sequence_number=self._n(), output_index=i, item=opened)),
            self._sse(ev.FunctionCallArgumentsDelta(sequence_number=self._n(), item_id=done.id,
                                                    output_index=i, delta=args)),
            self._sse(ev.FunctionCallArgumentsDone(sequence_number=self._n(), item_id=done.id,
                                                   output_index=i, arguments=args)),
            self._sse(ev.OutputItemDone(sequence_number=self._n(), output_index=i, item=done)),
        ]  # fmt: skip

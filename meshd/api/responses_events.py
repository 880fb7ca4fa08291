"""The events of a streamed response (``POST /v1/responses`` with ``stream``): each
an SSE ``event: <type>`` then its JSON, numbered, as the official ``openai`` client's
``openai.types.responses`` types them."""

from __future__ import annotations

from typing import Any

import msgspec

from .responses_schemas import OutputItem, OutputText, ReasoningText, Response

__all__ = [
    "ContentPartAdded",
    "ContentPartDone",
    "ErrorEvent",
    "ErrorEventDetail",
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputTextDelta",
    "OutputTextDone",
    "ReasoningTextDelta",
    "ReasoningTextDone",
    "ResponseCompleted",
    "ResponseCreated",
    "ResponseEvent",
    "ResponseInProgress",
    "ResponseIncomplete",
]


class _Event(msgspec.Struct, kw_only=True, tag_field="type"):
    """Every event: its ``type`` (the class's tag, also the SSE ``event:`` name) and its
    place in the stream."""

    sequence_number: int


class ResponseCreated(_Event, tag="response.created"):
    """The first event: the response, ``in_progress``, no output yet."""

    response: Response


class ResponseInProgress(_Event, tag="response.in_progress"):
    """The second event: the response is being generated."""

    response: Response


class ResponseCompleted(_Event, tag="response.completed"):
    """The last event of a response that ended by itself: the whole response, usage
    included."""

    response: Response


class ResponseIncomplete(_Event, tag="response.incomplete"):
    """The last event of a response cut at ``max_output_tokens``."""

    response: Response


class OutputItemAdded(_Event, tag="response.output_item.added"):
    """An output item opens (a message with no content yet, or a call with no
    arguments)."""

    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    """An output item is complete."""

    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    """A message's text part, or a reasoning item's, opens (empty)."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(_Event, tag="response.content_part.done"):
    """A message's text part, or a reasoning item's, is complete."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    """More text of a message."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(_Event, tag="response.output_text.done"):
    """A message's whole text."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(_Event, tag="response.reasoning_text.delta"):
    """More of a reasoning item's thoughts."""

    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(_Event, tag="response.reasoning_text.done"):
    """A reasoning item's whole thoughts."""

    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    """More of a call's arguments (here all of them at once: a call is read whole)."""

    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    """A call's whole arguments."""

    item_id: str
    output_index: int
    arguments: str


class ErrorEventDetail(msgspec.Struct, kw_only=True):
    """The nested ``error`` of an error event."""

    type: str
    code: str | None
    message: str
    param: str | None


class ErrorEvent(_Event, tag="error"):
    """A failure after the stream started (its status is sent): the last event.

    ``code``, ``message`` and ``param`` sit at the top level, as OpenAI documents the
    event (``openai.types.responses.ResponseErrorEvent``); they are repeated under
    ``error``, as OpenAI's servers send them, which is what makes the ``openai``
    client raise ``APIError`` rather than hand the event over.
    """

    code: str | None
    message: str
    param: str | None
    error: ErrorEventDetail


ResponseEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | ErrorEvent
)

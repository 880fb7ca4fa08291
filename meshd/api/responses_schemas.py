"""The bodies of OpenAI's Responses API (``POST /v1/responses``): the request, the
response object, its output items and the events of a streamed response.

Requests are decoded by :func:`meshd.api.bodies.parse_body`; each Struct checks its
fields in ``__post_init__`` with :mod:`meshd.api.rules`, so a bad field is a 400 that
names it, in OpenAI's shape. Responses are encoded with ``msgspec.json.encode`` and
follow the types of the official ``openai`` client (``openai.types.responses``).

What a request may carry
------------------------
* **Honoured**: ``model``, ``input`` (a string, or message, ``function_call`` and
  ``function_call_output`` items; ``reasoning`` items are skipped), ``instructions``,
  ``max_output_tokens``, ``temperature``, ``top_p``, ``tools`` (functions),
  ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``,
  ``json_schema``: a grammar), ``stream``, ``metadata`` (echoed), and the extensions
  chat completions take too: ``top_k``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``,
  ``seed`` and ``exact`` (the exact mode, :mod:`meshd.domain.exact`).
* **Rejected** (400 ``unsupported_parameter``): what needs state kept on the server
  (``previous_response_id``, ``conversation``, ``background``, ``item_reference``
  items), tools other than functions (``web_search``, ``file_search``, ...), and
  content other than text and ``input_image`` data URLs (files, audio, remote image
  URLs). Answering without them would silently lie to the client.
* **Ignored**: everything else (``store``, ``user``, ``reasoning``, ``truncation``,
  ``include``, and fields OpenAI adds later).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import msgspec

from meshd.domain.reasoning import ThinkChoice
from meshd.engines.grammar import json_schema_grammar

from .responses_content import InputContent, content_images, content_text
from .rules import (
    MAX_TOOLS,
    FieldError,
    check_function,
    check_int64,
    check_min,
    check_sampling_fields,
    schema_grammar,
    think_choice,
    unsupported,
)

__all__ = [
    "FunctionCallItem",
    "FunctionTool",
    "IncompleteDetails",
    "InputContent",
    "InputItem",
    "InputTokensDetails",
    "ItemStatus",
    "OutputItem",
    "OutputMessage",
    "OutputText",
    "OutputTokensDetails",
    "ReasoningConfig",
    "ReasoningItem",
    "ReasoningText",
    "Response",
    "ResponseRequest",
    "ResponseStatus",
    "ResponseUsage",
    "TextConfig",
    "TextFormat",
    "ToolChoice",
    "new_function_call_id",
    "new_message_id",
    "new_reasoning_id",
    "new_response_id",
]

ResponseStatus = Literal["completed", "incomplete", "in_progress"]
ItemStatus = Literal["completed", "incomplete", "in_progress"]

#: The roles a message item may have (``developer`` is OpenAI's newer ``system``).
_ROLES = frozenset({"user", "system", "developer", "assistant"})


def new_response_id() -> str:
    """A fresh response id, ``resp_`` and 32 hex digits."""
    return "resp_" + uuid.uuid4().hex


def new_message_id() -> str:
    """A fresh output message id, ``msg_`` and 32 hex digits."""
    return "msg_" + uuid.uuid4().hex


def new_reasoning_id() -> str:
    """A fresh reasoning item id, ``rs_`` and 32 hex digits."""
    return "rs_" + uuid.uuid4().hex


def new_function_call_id() -> str:
    """A fresh function call item id, ``fc_`` and 32 hex digits (the item's id; the
    call's own ``call_id`` is the one a ``function_call_output`` answers)."""
    return "fc_" + uuid.uuid4().hex


# ---------------------------------------------------------------------------------------
# the request


class InputItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One item of ``input``: a message (``type`` ``message``, or no ``type``), a
    ``function_call`` the assistant made, a ``function_call_output`` answering it, or a
    ``reasoning`` item (skipped: the models here keep no reasoning state). Other keys
    (``id``, ``status``, ``annotations``, ...) are ignored, so a previous response's
    ``output`` items can be sent back as they came."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None
    #: A ``reasoning`` item's summary (its thoughts are its ``content``).
    summary: list[InputContent] | None = None

    def __post_init__(self) -> None:
        if self.type == "message":
            if self.role not in _ROLES:
                raise FieldError(
                    "role", f"role must be one of 'user', 'system', 'developer' or "
                    f"'assistant', got {self.role!r}",
                )  # fmt: skip
            if self.content is None:
                raise FieldError("content", "a message needs content (a string or parts)")
            content_text(self.content, "content")
        elif self.type == "function_call":
            for name in ("call_id", "name", "arguments"):
                if getattr(self, name) is None:
                    raise FieldError(name, f"a function_call item needs a string `{name}`")
        elif self.type == "function_call_output":
            if self.call_id is None:
                raise FieldError("call_id", "a function_call_output item needs a `call_id`")
            if self.output is None:
                raise FieldError("output", "a function_call_output item needs an `output`")
            content_text(self.output, "output")
        elif self.type == "item_reference":
            raise unsupported(
                "type", "item_reference is not supported: meshd stores no items; send the "
                "item itself",
            )  # fmt: skip
        elif self.type != "reasoning":
            raise unsupported(
                "type", f"input item type {self.type!r} is not supported; use 'message', "
                "'function_call' or 'function_call_output'",
            )  # fmt: skip

    @property
    def text(self) -> str:
        """A message's content, or a function's output, as one string."""
        if self.type == "function_call_output":
            return content_text(self.output or "", "output")
        return content_text(self.content or "", "content")

    @property
    def images(self) -> list[bytes]:
        """A message's ``input_image`` parts as bytes, in order."""
        return content_images(self.content) if self.type == "message" else []

    @property
    def thoughts(self) -> str:
        """A ``reasoning`` item's thoughts (its summary where it has no content)."""
        parts = self.content if isinstance(self.content, list) else []
        return "\n".join(p.text or "" for p in parts or self.summary or ())


class FunctionTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One entry of ``tools``: a function, flat (``{"type": "function", "name", ...}``,
    not nested under ``function`` as chat completions nest it). Echoed in the response."""

    type: str
    name: str | None = None
    description: str | None = None
    #: JSON Schema of the arguments (absent: no arguments).
    parameters: dict[str, Any] | None = None
    #: The arguments of a forced call follow the schema whatever this says.
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.type != "function":
            raise unsupported(
                "type", f"tool type {self.type!r} is not supported; meshd offers only "
                "'function' tools (hosted tools such as web search need OpenAI's servers)",
            )  # fmt: skip
        if self.name is None:
            raise FieldError(
                "name", "a function tool needs a `name`; in the Responses API a tool is flat: "
                '{"type": "function", "name": ..., "parameters": ...}, not nested under '
                '"function"',
            )  # fmt: skip
        check_function(self.name, self.parameters)


class ToolChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``tool_choice: {"type": "function", "name": ...}``: that function is called."""

    type: str
    name: str | None = None

    def __post_init__(self) -> None:
        if self.type != "function":
            raise unsupported(
                "type", f"tool_choice type {self.type!r} is not supported; use 'auto', "
                "'none', 'required' or {'type': 'function', 'name': ...}",
            )  # fmt: skip
        if self.name is None:
            raise FieldError("name", "tool_choice {'type': 'function'} needs a `name`")


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``text.format``: ``text`` (the default), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON valid under ``schema``), by grammar-constrained sampling."""

    type: str
    name: str | None = None
    description: str | None = None
    #: ``schema`` on the wire; a Python name that shadows nothing of Struct's.
    json: Any = msgspec.field(name="schema", default=None)
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.type not in ("text", "json_object", "json_schema"):
            raise unsupported(
                "type", f"text.format type {self.type!r} is not supported; use 'text', "
                "'json_object' or 'json_schema'",
            )  # fmt: skip
        if self.type == "json_schema":
            if self.json is None:
                raise FieldError("schema", "type 'json_schema' needs `schema` (a JSON Schema)")
            schema_grammar(self.json, "schema")

    @property
    def grammar(self) -> str | None:
        """The grammar the answer follows (None: free text)."""
        if self.type == "json_object":
            return json_schema_grammar(None)
        if self.type == "json_schema":
            return json_schema_grammar(self.json)
        return None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``text``: how the answer is written (``verbosity`` is ignored)."""

    format: TextFormat = msgspec.field(default_factory=lambda: TextFormat(type="text"))


class ReasoningConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``reasoning``: how much a thinking model thinks (``none`` turns it off);
    ``summary`` is accepted (its thoughts come whole, no model here summarises)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Body of ``POST /v1/responses`` (see the module docstring for what is honoured)."""

    model: str
    input: str | list[InputItem]
    #: A system message put before ``input``.
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    #: Extensions (llama.cpp's, and meshd's ``exact``), as chat completions take them.
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    exact: bool | None = None
    seed: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoice | None = None
    #: False: at most one call per answer.
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    #: Echoed in the response, as OpenAI does; meshd stores nothing.
    metadata: dict[str, Any] | None = None
    #: Server-side state meshd does not keep: anything but null/false is a 400.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise FieldError("model", "model must be a non-empty string")
        if self.previous_response_id is not None:
            # A mesh of home machines shares no store: the node that answered the
            # previous response may be another node, or gone. The client holds the
            # conversation, and sends it whole.
            raise unsupported(
                "previous_response_id", "previous_response_id is not supported: meshd keeps "
                "no conversation state on the server (any node of the mesh may answer the "
                "next request); send the whole conversation in `input`",
            )  # fmt: skip
        if self.conversation is not None:
            raise unsupported(
                "conversation", "conversation is not supported: meshd keeps no conversation "
                "state on the server; send the whole conversation in `input`",
            )  # fmt: skip
        if self.background:
            raise unsupported(
                "background", "background responses are not supported: meshd stores no "
                "responses to poll; stream the response instead",
            )  # fmt: skip
        check_int64(self)
        check_min("max_output_tokens", self.max_output_tokens, 1)
        check_sampling_fields(self)
        _ = self.think  # raises FieldError for an effort no model knows
        if isinstance(self.input, str):
            if not self.input:
                raise FieldError("input", "input must be a non-empty string or list of items")
        elif all(item.type == "reasoning" for item in self.input):
            raise FieldError("input", "input must hold at least one message")
        if self.tools and len(self.tools) > MAX_TOOLS:
            raise FieldError("tools", f"at most {MAX_TOOLS} tools, got {len(self.tools)}")
        if isinstance(self.tool_choice, ToolChoice):
            name = self.tool_choice.name
            if name not in {t.name for t in self.tools or ()}:
                raise FieldError("tool_choice", f"tool_choice names {name!r}, not among tools")
        elif self.tool_choice == "required" and not self.tools:
            raise FieldError("tool_choice", "tool_choice 'required' needs tools")

    @property
    def tool_mode(self) -> str | None:
        """None (no tools offered, or ``none``), ``auto``, ``required`` or the name of
        the function the model must call."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, ToolChoice):
            return self.tool_choice.name
        return self.tool_choice or "auto"

    @property
    def think(self) -> ThinkChoice:
        """How the model should think (``reasoning.effort``)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        return think_choice(effort, "reasoning.effort")


# ---------------------------------------------------------------------------------------
# the response: output items


class OutputText(msgspec.Struct, kw_only=True, tag="output_text", tag_field="type"):
    """The text part of an output message."""

    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    """The assistant's text, as an output item."""

    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(msgspec.Struct, kw_only=True, tag="reasoning_text", tag_field="type"):
    """The thoughts of a reasoning item, as the model wrote them."""

    text: str


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    """A thinking model's thoughts, as an output item before its answer: whole in
    ``content`` (no model here writes a summary of them)."""

    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: ItemStatus = "completed"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    """A call the model made, as an output item: ``call_id`` is what its
    ``function_call_output`` answers."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


# ---------------------------------------------------------------------------------------
# the response object


class InputTokensDetails(msgspec.Struct, kw_only=True):
    """Of the input tokens, those the prefix cache gave (``cached_tokens``); meshd
    writes no cache a client pays for (``cache_write_tokens``: 0)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    """Of the output tokens, a thinking model's thoughts (markers included)."""

    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    """Token counts of one response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(
        cls, input_tokens: int, output_tokens: int, reasoning_tokens: int = 0, cached: int = 0
    ) -> ResponseUsage:
        """Usage with ``total_tokens`` computed."""
        return cls(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=input_tokens + output_tokens,
        )


class IncompleteDetails(msgspec.Struct, kw_only=True):
    """Why a response ended early: the only reason here is ``max_output_tokens``."""

    reason: Literal["max_output_tokens"] = "max_output_tokens"


class Response(msgspec.Struct, kw_only=True):
    """A response object: the body of a non-streamed ``POST /v1/responses``, and what
    the lifecycle events of a streamed one carry. The request's settings are echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | ToolChoice = "auto"
    tools: list[FunctionTool] = []
    parallel_tool_calls: bool = True
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    error: None = None
    previous_response_id: None = None
    #: Nothing is stored: there is nothing to retrieve by id later.
    store: bool = False
    background: bool = False
    metadata: dict[str, Any] = {}

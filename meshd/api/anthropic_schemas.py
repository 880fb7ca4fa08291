"""Anthropic Messages schemas (``/v1/messages``): request and response bodies as Structs.

Honoured: ``system`` (a string or text blocks), ``messages`` with text, ``image``
(``source.type: base64``; a ``url`` source is refused: nodes never fetch), ``tool_use``
and ``tool_result`` blocks, ``max_tokens``, ``stop_sequences``, ``temperature`` (0-1),
``top_p``, ``top_k``, ``stream``, ``tools`` (custom tools: ``name``, ``description``,
``input_schema``), ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``, with
``disable_parallel_tool_use``) and ``thinking`` (``enabled`` with ``budget_tokens``, a
cap on the thought tokens; ``disabled``, with the model's own switch; ``adaptive``;
``display: omitted``), and structured output: ``output_config.format``
(``{"type": "json_schema", "schema": {...}}``, what the SDK's ``messages.parse`` and
langchain-anthropic's ``with_structured_output`` send; the older beta sent the same
object as a top-level ``output_format``, also read): the answer is constrained to the
schema, as by OpenAI's ``response_format`` ``json_schema``. ``thinking`` blocks of
earlier answers go back to the template as the assistant turn's thoughts (most
templates drop past thoughts); their signature is not checked, and
``redacted_thinking`` blocks are dropped. Accepted and ignored: ``metadata``,
``cache_control`` anywhere, ``service_tier``, ``container``, ``output_config.effort``.
A 400 names what cannot be done: document blocks, image URLs, other output formats, and
server tools (web search, code execution, ...), which run on Anthropic's side.

The ``anthropic`` SDK (2.x) takes ``temperature``, ``top_p`` and ``top_k`` through
``extra_body`` only; they arrive in the body all the same.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from meshd.domain.reasoning import ThinkChoice
from meshd.engines.grammar import json_schema_grammar

from .images import image_bytes, url_image
from .rules import (
    MAX_TOOLS,
    FieldError,
    check_function,
    check_int64,
    check_min,
    check_range,
    check_sampling_fields,
    check_stops,
    schema_grammar,
    unsupported,
)

__all__ = [
    "Block",
    "CountTokensRequest",
    "MessageParam",
    "MessagesRequest",
    "OutputConfig",
    "OutputFormat",
    "ResponseBlock",
    "SystemBlock",
    "ThinkingConfig",
    "ToolChoice",
    "ToolParam",
    "Usage",
]

#: Block types of a request meshd reads; thinking blocks are dropped.
_READ = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"})


class ImageSource(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An image block's ``source``: ``base64`` data only (nodes never fetch a ``url``)."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    def __post_init__(self) -> None:
        if self.type == "url":
            url_image(self.url or "", "url")  # a remote URL: refused, and says why
        elif self.type != "base64":
            raise unsupported(
                "type", f"image source type {self.type!r} is not supported; send base64 data"
            )
        elif self.data is None:
            raise FieldError("data", "a base64 image source needs `data`")
        else:
            image_bytes(self.data, "data")

    @property
    def image(self) -> bytes:
        """The image's bytes."""
        if self.type == "url":
            return url_image(self.url or "", "url")
        return image_bytes(self.data or "", "data")


class Block(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One content block of a message (one Struct for every type: each type's fields
    are checked below, and an unknown type gets a message naming it)."""

    type: str
    text: str | None = None
    #: tool_use
    id: str | None = None
    name: str | None = None
    input: Any = None
    #: tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    #: thinking (its signature is not checked: the thoughts are a local model's)
    thinking: str | None = None
    #: image
    source: ImageSource | None = None

    def __post_init__(self) -> None:
        if self.type not in _READ:
            raise unsupported(
                "type",
                f"content block type {self.type!r} is not supported; meshd reads text, "
                "image, tool_use and tool_result blocks",
            )
        if self.type == "image" and self.source is None:
            raise FieldError("source", "an image block needs a `source`")
        if self.type == "text" and self.text is None:
            raise FieldError("text", "a text block needs a string `text`")
        if self.type == "tool_use" and (not self.id or not self.name):
            raise FieldError("id", "a tool_use block needs `id` and `name`")
        if self.type == "tool_use" and not isinstance(self.input, dict | None):
            raise FieldError("input", "a tool_use block's input is an object")
        if self.type == "tool_result" and not self.tool_use_id:
            raise FieldError("tool_use_id", "a tool_result block needs `tool_use_id`")

    @property
    def result_text(self) -> str:
        """A tool_result's content as text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(b.text or "" for b in self.content if b.type == "text")


class MessageParam(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class SystemBlock(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["text"] = "text"
    text: str


class ToolParam(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A custom tool; typed server tools (``web_search_...``, ``bash_...``) are refused."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None

    def __post_init__(self) -> None:
        if self.type not in (None, "custom"):
            raise unsupported(
                "type",
                f"tool type {self.type!r} is not supported: server tools run at Anthropic; "
                "offer a custom tool (name, description, input_schema)",
            )
        check_function(self.name, self.input_schema, params_field="input_schema")


class ToolChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def __post_init__(self) -> None:
        if self.type == "tool" and not self.name:
            raise FieldError("name", "tool_choice type 'tool' needs the tool's `name`")


class OutputFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``output_config.format`` (or the older beta's top-level ``output_format``): the
    JSON Schema the answer follows. A schema the grammar engine cannot compile is a 400
    that says why."""

    type: str
    #: ``schema`` on the wire; a Python name that shadows no builtin.
    json: Any = msgspec.field(name="schema", default=None)

    def __post_init__(self) -> None:
        if self.type != "json_schema":
            raise unsupported(
                "type", f"output format type {self.type!r} is not supported; use 'json_schema'"
            )
        if self.json is None:
            raise FieldError("schema", "type 'json_schema' needs `schema` (a JSON Schema)")
        schema_grammar(self.json, "schema")  # raises a FieldError that says why


class OutputConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``output_config``: ``format`` is honoured; ``effort`` (how hard Claude thinks)
    is accepted and ignored, as the other knobs of Anthropic's own models."""

    format: OutputFormat | None = None
    effort: str | None = None


class _Conversation(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    messages: list[MessageParam]
    system: str | list[SystemBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None

    def _check(self) -> None:
        if not self.model.strip():
            raise FieldError("model", "model must be a non-empty string")
        if not self.messages:
            raise FieldError("messages", "messages must hold at least one message")
        if self.tools and len(self.tools) > MAX_TOOLS:
            raise FieldError("tools", f"at most {MAX_TOOLS} tools, got {len(self.tools)}")
        c = self.tool_choice
        if c is not None and c.type == "tool" and c.name not in {t.name for t in self.tools or ()}:
            raise FieldError("tool_choice", f"tool_choice names {c.name!r}, not among tools")
        if c is not None and c.type == "any" and not self.tools:
            raise FieldError("tool_choice", "tool_choice 'any' needs tools")

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or ``none``), ``auto``, ``required`` or the tool's name."""
        c = self.tool_choice
        if not self.tools or (c is not None and c.type == "none"):
            return None
        if c is None or c.type == "auto":
            return "auto"
        return "required" if c.type == "any" else c.name

    @property
    def system_text(self) -> str:
        """The system prompt as one text."""
        if self.system is None:
            return ""
        if isinstance(self.system, str):
            return self.system
        return "\n".join(b.text for b in self.system)


class ThinkingConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``thinking``: ``enabled`` (at most ``budget_tokens`` thought tokens),
    ``disabled``, or ``adaptive`` (the model decides, as with any other type);
    ``display: omitted`` sends the thinking blocks empty."""

    type: str
    budget_tokens: int | None = None
    display: str | None = None

    def __post_init__(self) -> None:
        # Another type (Anthropic adds them: ``between_tools``) leaves it to the model.
        if self.type == "enabled" and self.budget_tokens is None:
            raise FieldError("budget_tokens", "thinking type 'enabled' needs budget_tokens")
        check_min("budget_tokens", self.budget_tokens, 1)

    @property
    def choice(self) -> ThinkChoice:
        """How the model should think."""
        enabled = {"enabled": True, "disabled": False}.get(self.type)
        budget = self.budget_tokens if self.type == "enabled" else None
        return ThinkChoice(enabled=enabled, budget=budget)


class MessagesRequest(_Conversation, kw_only=True, omit_defaults=True):
    """Body of ``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    #: The structured-outputs beta's spelling of ``output_config.format``.
    output_format: OutputFormat | None = None
    #: Extension (every dialect): the exact mode, see ``schemas._GenerationRequest``.
    exact: bool | None = None

    def __post_init__(self) -> None:
        self._check()
        if self.output_format is not None and self.output_config and self.output_config.format:
            raise FieldError(
                "output_format", "send output_config.format or output_format, not both"
            )
        check_int64(self)
        check_min("max_tokens", self.max_tokens, 1)
        check_range("temperature", self.temperature, 0.0, 1.0)  # Anthropic's own bound
        check_sampling_fields(self)
        check_stops(self.stop_sequences or [], "stop_sequences")

    @property
    def grammar(self) -> str | None:
        """The grammar the answer follows (None: free text)."""
        fmt = self.output_format or (self.output_config.format if self.output_config else None)
        return None if fmt is None else json_schema_grammar(fmt.json)


class CountTokensRequest(_Conversation, kw_only=True, omit_defaults=True):
    """Body of ``POST /v1/messages/count_tokens``."""

    thinking: ThinkingConfig | None = None

    def __post_init__(self) -> None:
        self._check()


# ---------------------------------------------------------------------------------------
# responses


class ResponseBlock(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A block of an answer: ``thinking``, ``text`` or ``tool_use``."""

    type: Literal["thinking", "text", "tool_use"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    thinking: str | None = None
    signature: str | None = None


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct, kw_only=True):
    """The body of a whole answer (and, empty, of ``message_start``)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage

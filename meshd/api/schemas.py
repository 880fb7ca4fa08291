"""The OpenAI-compatible HTTP schemas: every request and response body, in one place.

Requests are decoded at the edge by :func:`meshd.api.bodies.parse_body`; a Struct that
comes out of it has passed every rule below, so route code reads typed, checked values.
Responses are encoded with ``msgspec.json.encode`` and mirror OpenAI's wire format
closely enough that the official ``openai`` client (v1.x) parses them.

What a request may carry
------------------------
Fields fall in four groups, decided once here:

* **Honoured**: ``model``, ``messages`` / ``prompt``, ``max_tokens`` (and
  ``max_completion_tokens`` for chat), ``temperature``, ``top_p``, ``seed``, ``stop``,
  ``stream``, ``stream_options.include_usage``, ``presence_penalty`` and
  ``frequency_penalty`` (-2..2, over the tokens generated so far), ``logit_bias``
  (token id -> -100..100), and the llama.cpp extensions ``top_k``, ``min_p``,
  ``repeat_penalty`` and ``repeat_last_n``. A sampling field left out gets the model's
  own default or the server's (``meshd.api.sampling``). ``logprobs`` and
  ``top_logprobs`` (chat), ``logprobs: N`` (completions): see ``meshd.api.logprobs``.
  ``n`` (1-8) choices, each its own run through the pipeline. ``response_format``
  ``json_object`` / ``json_schema``: the answer is constrained to the schema
  (:mod:`meshd.engines.grammar`). ``tools``, ``tool_choice`` and
  ``parallel_tool_calls``: see :mod:`meshd.models.tools` and :mod:`meshd.api.toolcalls`.
* **Rejected when they ask for something we cannot do** (400, ``code``
  ``unsupported_parameter``): non-empty ``functions`` (the deprecated form of
  ``tools``), a tool type other than ``function``,
  a ``response_format`` type other than those three, and for completions ``echo: true``,
  ``best_of`` other than 1 and a non-empty ``suffix``.
  Each would change the shape or the meaning of the answer; answering without it
  would silently lie to the client. Their neutral values (``functions: []``, ``echo:
  false`` and so on) are accepted, because clients send defaults.
* **Ignored**: every other field, known to OpenAI (``user``, ``metadata``, ``store``,
  ``service_tier``, ...) or not. OpenAI
  clients add fields release after release; an unknown field must never fail a request.

Validation lives in the ``__post_init__`` of each request Struct, so it runs on decode
and on construction in Python alike. A rule that fails raises :class:`FieldError`;
msgspec wraps it in a ``ValidationError`` carrying the JSON path, and
:func:`meshd.api.bodies.parse_body` turns that into a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

from meshd.domain.reasoning import ThinkChoice
from meshd.domain.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_TOP_LOGPROBS,
)
from meshd.engines.grammar import GrammarError, check_grammar, json_schema_grammar

from .content_parts import ContentPart, parts_images, parts_text
from .rules import INT64_MAX as _INT64_MAX
from .rules import MAX_TOOLS, FieldError, check_function, check_sampling_fields, check_stops
from .rules import check_int64 as _check_int64
from .rules import check_min as _check_min
from .rules import check_range as _check_range
from .rules import think_choice as _think_choice
from .rules import unsupported as _unsupported

__all__ = [
    "MAX_CHOICES",
    "MAX_STOP_SEQUENCES",
    "MAX_TOOLS",
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionRequest",
    "ChatDelta",
    "ChatMessage",
    "ChatStream",
    "ChatTokenLogprob",
    "ChatTopLogprob",
    "ChoiceLogprobs",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionStream",
    "CompletionTokensDetails",
    "ContentPart",
    "ErrorDetail",
    "ErrorResponse",
    "FieldError",
    "FinishReason",
    "FunctionCall",
    "FunctionCallDelta",
    "FunctionDef",
    "JsonSchemaFormat",
    "Model",
    "ModelList",
    "NamedFunction",
    "ResponseFormat",
    "Role",
    "StreamOptions",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoiceFunction",
    "Usage",
    "new_chat_completion_id",
    "new_completion_id",
    "unix_time",
]

#: Most stop sequences an OpenAI request may carry (OpenAI's limit).
MAX_STOP_SEQUENCES = 4
#: Most choices (``n``) one request may ask for: each is a run through the pipeline.
MAX_CHOICES = 8


Role = Literal["system", "user", "assistant", "developer", "tool"]
FinishReason = Literal["stop", "length", "tool_calls"]


# ---------------------------------------------------------------------------------------
# ids and timestamps


def new_chat_completion_id() -> str:
    """A fresh chat completion id, ``chatcmpl-`` and 32 hex digits."""
    return "chatcmpl-" + uuid.uuid4().hex


def new_completion_id() -> str:
    """A fresh text completion id, ``cmpl-`` and 32 hex digits."""
    return "cmpl-" + uuid.uuid4().hex


def unix_time() -> int:
    """Now, in whole Unix seconds: the ``created`` field of every response."""
    return int(time.time())


# ---------------------------------------------------------------------------------------
# validation


def _check_common(req: _GenerationRequest) -> None:
    """The rules every generation request shares, in one place."""
    # A blank name is no name: model resolution strips it and finds nothing to look up.
    if not req.model.strip():
        raise FieldError("model", "model must be a non-empty string")
    _check_int64(req)
    _check_min("max_tokens", req.max_tokens, 1)
    # Its logit_bias keys are strings: token_bias parses and checks them.
    check_sampling_fields(req, skip=("logit_bias",))
    check_stops(req.stop_sequences, most=MAX_STOP_SEQUENCES)
    _check_range("n", req.n, 1, MAX_CHOICES)
    _ = req.token_bias  # raises FieldError for a bad logit_bias


# ---------------------------------------------------------------------------------------
# requests


class StreamOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``stream_options``: only ``include_usage`` is honoured; other keys are ignored.

    Ignored as well when ``stream`` is false (OpenAI rejects that combination; nothing
    is lost by tolerating it).
    """

    include_usage: bool | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``response_format.json_schema``: the schema the answer must follow.

    The output is constrained to the schema whatever ``strict`` says (a best effort
    that can fail helps no client); a schema the grammar engine cannot compile is a
    400 that says why.
    """

    name: str | None = None
    description: str | None = None
    #: ``schema`` on the wire (JSON Schema); a Python name that shadows no builtin.
    json: Any = msgspec.field(name="schema", default=None)
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``response_format``: ``text`` (the default), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON valid under a schema), by grammar-constrained sampling."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None

    def __post_init__(self) -> None:
        if self.type not in ("text", "json_object", "json_schema"):
            raise _unsupported(
                "type",
                f"response_format type {self.type!r} is not supported; "
                "use 'text', 'json_object' or 'json_schema'",
            )
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json is None:
                raise FieldError(
                    "json_schema", "type 'json_schema' needs json_schema.schema (a JSON Schema)"
                )
            if not isinstance(self.json_schema.json, dict | bool):
                raise FieldError("json_schema.schema", "a JSON Schema is an object")
        try:
            grammar = self.grammar
            if grammar is not None:
                check_grammar(grammar)
        except GrammarError as e:
            param = "json_schema.schema" if self.type == "json_schema" else "type"
            raise FieldError(
                param, f"the schema cannot be compiled: {e}", code="invalid_json_schema"
            ) from None

    @property
    def grammar(self) -> str | None:
        """The grammar the answer follows (None: free text)."""
        if self.type == "json_object":
            return json_schema_grammar(None)
        if self.type == "json_schema" and self.json_schema is not None:
            return json_schema_grammar(self.json_schema.json)
        return None


class _GenerationRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Fields shared by chat and text completion requests (see the module docstring)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    #: Extension (llama.cpp, vLLM): sample from the k most likely tokens; 0 = no limit.
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    #: Choices to generate (1-8), each its own run; a seeded one draws from seed + index.
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    #: Token id (as a string, as JSON keys are) -> value added to its logit.
    logit_bias: dict[str, float] | None = None
    #: Extensions (llama.cpp): drop tokens less likely than ``min_p`` times the most
    #: likely one; divide the logits of recent tokens by ``repeat_penalty``, counting
    #: the last ``repeat_last_n`` generated (-1: all, 0: off).
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    #: Extension (vLLM): keep generating past end-of-sequence until ``max_tokens``
    #: (benchmarks and tests need a fixed length).
    ignore_eos: bool = False
    #: Extensions: ``cache_prompt`` (llama.cpp server's) false computes the whole prompt
    #: on a cold runner, true or absent may start from a cached prefix; ``speculate``
    #: true drafts tokens by prompt lookup to verify in one pass, false never, absent as
    #: the instance says, else on a split; ``exact`` (every dialect) true runs in the
    #: exact mode (neither: the same tokens bit for bit whatever ran before), false not
    #: even on an instance placed exact, absent as the instance says.
    cache_prompt: bool | None = None
    speculate: bool | None = None
    exact: bool | None = None

    @property
    def stop_sequences(self) -> list[str]:
        """``stop`` as a list (empty when absent)."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    @property
    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with integer keys; FieldError names a bad key or value."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise FieldError(
                "logit_bias",
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}",
            )
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                tok = int(key)
            except ValueError:
                tok = -1
            if tok < 0 or tok > _INT64_MAX or str(tok) != key.strip():
                raise FieldError(
                    "logit_bias", f"logit_bias keys must be token ids (0, 1, ...), got {key!r}"
                )
            _check_range("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            out[tok] = float(value)
        return out

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage-only chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def max_new_tokens(self) -> int | None:
        """How many tokens to generate at most; ``None`` leaves it to the server."""
        return self.max_tokens


class FunctionCall(msgspec.Struct, kw_only=True):
    """``tool_calls[].function``: a function's name and its arguments as JSON text."""

    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct, kw_only=True):
    """A function call: in an assistant message of the history, or of the answer."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message of a chat request.

    ``content`` may be ``None`` only for ``assistant`` messages (next to their
    ``tool_calls``). A ``tool`` message answers the call ``tool_call_id`` names.
    Anything else on a message is ignored.
    """

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    #: An earlier answer's thoughts, as they came (vLLM's newer name: ``reasoning``).
    reasoning_content: str | None = None
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"content is required for role {self.role!r}")
        if self.tool_calls and self.role != "assistant":
            raise FieldError("tool_calls", "only assistant messages carry tool_calls")

    @property
    def text(self) -> str:
        """The content as one string (see :func:`.content_parts.parts_text`)."""
        return parts_text(self.content)

    @property
    def images(self) -> list[bytes]:
        """The bytes of its image parts, in order."""
        return parts_images(self.content)


class FunctionDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``tools[].function``: a function the model may call."""

    name: str
    description: str | None = None
    #: JSON Schema of the arguments (an object schema; absent: no arguments).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        check_function(self.name, self.parameters)


class Tool(msgspec.Struct, kw_only=True):
    """One entry of ``tools``: only functions are supported."""

    type: str = "function"
    function: FunctionDef

    def __post_init__(self) -> None:
        if self.type != "function":
            raise _unsupported("type", f"tool type {self.type!r} is not supported; use 'function'")


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest, kw_only=True, omit_defaults=True):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    #: Newer name of ``max_tokens``; send either. Both must agree when both are sent.
    max_completion_tokens: int | None = None
    #: Return each token's log-probability, and ``top_logprobs`` alternatives (0-20).
    logprobs: bool | None = None
    top_logprobs: int | None = None
    #: ``text``, ``json_object`` or ``json_schema`` (see :class:`ResponseFormat`).
    response_format: ResponseFormat | None = None
    #: Functions the model may call (up to 128).
    tools: list[Tool] | None = None
    #: ``auto`` (the default with tools), ``none``, ``required`` or one function.
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    #: False: at most one call per answer (a forced choice always makes one).
    parallel_tool_calls: bool | None = None
    #: Deprecated form of ``tools``; only empty (or absent) is accepted.
    functions: list[dict[str, Any]] | None = None
    #: How much a reasoning model thinks (``none`` .. ``xhigh``; see ``think``).
    reasoning_effort: str | None = None
    #: Extension (vLLM, llama-server): more variables for the chat template;
    #: ``enable_thinking: false`` turns thinking off.
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_common(self)
        _ = self.think  # raises FieldError for an effort no model knows
        if not self.messages:
            raise FieldError("messages", "messages must hold at least one message")
        _check_min("max_completion_tokens", self.max_completion_tokens, 1)
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise FieldError(
                "max_completion_tokens",
                f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                f"({self.max_completion_tokens}) disagree; send one of them",
            )
        _check_range("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.tools and len(self.tools) > MAX_TOOLS:
            raise FieldError("tools", f"at most {MAX_TOOLS} tools, got {len(self.tools)}")
        if isinstance(self.tool_choice, ToolChoiceFunction):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools or ()}:
                raise FieldError("tool_choice", f"tool_choice names {name!r}, not among tools")
        elif self.tool_choice == "required" and not self.tools:
            raise FieldError("tool_choice", "tool_choice 'required' needs tools")
        if self.functions:
            raise _unsupported("functions", "functions (function calling) are not supported")

    @property
    def n_logprobs(self) -> int | None:
        """Alternatives to return per token; None: no log-probabilities at all."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_mode(self) -> str | None:
        """None (no tools offered, or ``none``), ``auto``, ``required`` or the name of
        the function the model must call."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, ToolChoiceFunction):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    @property
    def think(self) -> ThinkChoice:
        """How the model should think: ``reasoning_effort``, and the template's own
        ``enable_thinking`` where the client sets it."""
        enabled = (self.chat_template_kwargs or {}).get("enable_thinking")
        return _think_choice(
            self.reasoning_effort, "reasoning_effort",
            enabled=enabled if isinstance(enabled, bool) else None,
        )  # fmt: skip

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` or ``max_tokens``; ``None`` leaves it to the server."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_GenerationRequest, kw_only=True, omit_defaults=True):
    """Body of ``POST /v1/completions`` (the legacy text completion API).

    OpenAI's own default for ``max_tokens`` here is 16; :attr:`max_new_tokens` returns
    ``None`` when it is absent and the route decides.
    """

    #: One prompt: a string, or a list holding exactly one string. Token arrays and
    #: batches are not supported.
    prompt: str | list[str]
    #: Only ``false`` (or absent) is accepted.
    echo: bool | None = None
    #: Only 1 (or absent) is accepted.
    best_of: int | None = None
    #: Return each token's log-probability and this many alternatives' (0-20).
    logprobs: int | None = None
    #: Only empty (or absent) is accepted.
    suffix: str | None = None

    def __post_init__(self) -> None:
        _check_common(self)
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise _unsupported(
                "prompt",
                "prompt must be a string or a list of exactly one string "
                f"(batched prompts are not supported), got a list of {len(self.prompt)}",
            )
        if self.echo:
            raise _unsupported("echo", "echo is not supported; send false or omit it")
        if self.best_of is not None and self.best_of != 1:
            raise _unsupported("best_of", f"only best_of=1 is supported, got {self.best_of}")
        _check_range("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.suffix:
            raise _unsupported("suffix", "suffix (insertion) is not supported")

    @property
    def n_logprobs(self) -> int | None:
        """Alternatives to return per token; None: no log-probabilities at all."""
        return self.logprobs

    @property
    def prompt_text(self) -> str:
        """The single prompt as a string."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# ---------------------------------------------------------------------------------------
# responses


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    #: Prompt tokens whose KV came from the prefix cache (as OpenAI reports its own).
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct, kw_only=True):
    #: Of the completion tokens, the model's thoughts (markers included).
    reasoning_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    #: Left out when nothing came from the prefix cache.
    prompt_tokens_details: PromptTokensDetails | msgspec.UnsetType = msgspec.UNSET
    #: Left out when the model did not think.
    completion_tokens_details: CompletionTokensDetails | msgspec.UnsetType = msgspec.UNSET

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        reasoning_tokens: int = 0,
    ) -> Usage:
        """Usage with ``total_tokens`` computed."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens)
            if cached_tokens
            else msgspec.UNSET,
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
            if reasoning_tokens
            else msgspec.UNSET,
        )


class AssistantMessage(msgspec.Struct, kw_only=True):
    """The message of a non-streamed chat choice (``content`` null next to calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    #: Left out of the JSON when the answer calls nothing (as OpenAI does).
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET
    #: A thinking model's thoughts, under llama-server's and DeepSeek's name and
    #: vLLM's newer one (left out when it did not think).
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | msgspec.UnsetType = msgspec.UNSET


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of a call: the first names it (``id``, ``function.name``), the
    next ones add to ``function.arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatTopLogprob(msgspec.Struct, kw_only=True):
    """One likely token at a position: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    """A token of the answer with its log-probability and the most likely tokens'."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = []


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    """``choices[].logprobs`` of a chat completion (and of each streamed chunk)."""

    content: list[ChatTokenLogprob] | None = None
    refusal: None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """``choices[].logprobs`` of a text completion (the legacy shape)."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] | None = None
    #: Character offset of each token in the prompt followed by the completion.
    text_offset: list[int] = []


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    """One choice of a :class:`ChatCompletion`."""

    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(msgspec.Struct, kw_only=True):
    """Response of a non-streamed ``POST /v1/chat/completions``."""

    id: str = msgspec.field(default_factory=new_chat_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = msgspec.field(default_factory=unix_time)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage

    @classmethod
    def single(
        cls,
        *,
        model: str,
        content: str,
        finish_reason: FinishReason,
        usage: Usage,
        id: str | None = None,
        created: int | None = None,
        logprobs: ChoiceLogprobs | None = None,
    ) -> ChatCompletion:
        """The usual one-choice answer."""
        return cls(
            id=id or new_chat_completion_id(),
            created=unix_time() if created is None else created,
            model=model,
            choices=[
                ChatCompletionChoice(
                    message=AssistantMessage(content=content),
                    finish_reason=finish_reason,
                    logprobs=logprobs,
                )
            ],
            usage=usage,
        )


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a chunk adds to the message; absent keys are left out of the JSON.

    The first chunk carries ``role`` (and empty ``content``), the next ones
    ``content``, the finishing chunk an empty delta ``{}``.
    """

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    #: More thoughts (under both names, as :class:`AssistantMessage`).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionChunkChoice(msgspec.Struct, kw_only=True):
    """One choice of a :class:`ChatCompletionChunk`."""

    index: int = 0
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE event of a streamed chat completion.

    Every chunk of a stream has the same ``id`` and ``created``. With
    ``stream_options.include_usage`` the stream ends with a chunk whose ``choices`` is
    empty and whose ``usage`` is set; ``usage`` is ``null`` on every other chunk.
    """

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None


class CompletionChoice(msgspec.Struct, kw_only=True):
    """One choice of a :class:`Completion` or :class:`CompletionChunk`.

    ``finish_reason`` is ``null`` on streamed chunks until the last one.
    """

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(msgspec.Struct, kw_only=True):
    """Response of a non-streamed ``POST /v1/completions``."""

    id: str = msgspec.field(default_factory=new_completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = msgspec.field(default_factory=unix_time)
    model: str
    choices: list[CompletionChoice]
    usage: Usage

    @classmethod
    def single(
        cls,
        *,
        model: str,
        text: str,
        finish_reason: FinishReason,
        usage: Usage,
        id: str | None = None,
        created: int | None = None,
        logprobs: CompletionLogprobs | None = None,
    ) -> Completion:
        """The usual one-choice answer."""
        return cls(
            id=id or new_completion_id(),
            created=unix_time() if created is None else created,
            model=model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason, logprobs=logprobs)],
            usage=usage,
        )


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One SSE event of a streamed text completion (OpenAI reuses ``text_completion``).

    With ``include_usage`` the stream ends with ``choices: []`` and ``usage`` set.
    """

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(msgspec.Struct, kw_only=True):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = msgspec.field(default_factory=unix_time)
    owned_by: str = "meshd"


class ModelList(msgspec.Struct, kw_only=True):
    """Response of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[Model] = []


class ErrorDetail(msgspec.Struct, kw_only=True):
    """The ``error`` object of an error response (all four keys always present)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


# ---------------------------------------------------------------------------------------
# stream builders


class ChatStream:
    """Builds the chunks of one streamed chat completion (same id, created and model).

    >>> s = ChatStream("llama")
    >>> [c.choices[0].delta for c in (s.start(), s.content("Hi"), s.finish("stop"))]
    [ChatDelta(role='assistant', content=''), ChatDelta(role=None, content='Hi'), ChatDelta(role=None, content=None)]
    """  # noqa: E501

    def __init__(self, model: str, *, id: str | None = None, created: int | None = None) -> None:
        self.model = model
        self.id = id or new_chat_completion_id()
        self.created = unix_time() if created is None else created

    def _chunk(
        self, choices: list[ChatCompletionChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def start(self, index: int = 0) -> ChatCompletionChunk:
        """The first chunk of a choice: ``delta: {"role": "assistant", "content": ""}``."""
        return self._chunk(
            [ChatCompletionChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))]
        )

    def content(
        self, text: str, logprobs: ChoiceLogprobs | None = None, *, index: int = 0
    ) -> ChatCompletionChunk:
        """A chunk adding ``text`` to the message (and its tokens' log-probabilities)."""
        return self._chunk(
            [
                ChatCompletionChunkChoice(
                    index=index, delta=ChatDelta(content=text), logprobs=logprobs
                )
            ]
        )

    def reasoning(self, text: str, *, index: int = 0) -> ChatCompletionChunk:
        """A chunk adding ``text`` to the thoughts."""
        delta = ChatDelta(reasoning_content=text, reasoning=text)
        return self._chunk([ChatCompletionChunkChoice(index=index, delta=delta)])

    def tool_call(self, call: ToolCall, n: int, *, index: int = 0) -> list[ChatCompletionChunk]:
        """The chunks of the ``n``-th call of a choice: its name, then its arguments."""
        f = call.function
        return [
            self._chunk([ChatCompletionChunkChoice(index=index, delta=ChatDelta(tool_calls=[
                ToolCallDelta(index=n, id=call.id, type="function",
                              function=FunctionCallDelta(name=f.name, arguments=""))]))]),
            self._chunk([ChatCompletionChunkChoice(index=index, delta=ChatDelta(tool_calls=[
                ToolCallDelta(index=n, function=FunctionCallDelta(arguments=f.arguments))]))]),
        ]  # fmt: skip

    def finish(self, reason: FinishReason, *, index: int = 0) -> ChatCompletionChunk:
        """The chunk that ends a choice: empty delta, ``finish_reason`` set."""
        return self._chunk(
            [ChatCompletionChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)]
        )

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        """The usage-only chunk sent last when ``include_usage`` was asked for."""
        return self._chunk([], usage=usage)


class CompletionStream:
    """Builds the chunks of one streamed text completion (same id, created and model)."""

    def __init__(self, model: str, *, id: str | None = None, created: int | None = None) -> None:
        self.model = model
        self.id = id or new_completion_id()
        self.created = unix_time() if created is None else created

    def _chunk(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionChunk:
        return CompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def content(
        self, text: str, logprobs: CompletionLogprobs | None = None, *, index: int = 0
    ) -> CompletionChunk:
        """A chunk adding ``text`` (and its tokens' log-probabilities)."""
        return self._chunk([CompletionChoice(index=index, text=text, logprobs=logprobs)])

    def finish(self, reason: FinishReason, text: str = "", *, index: int = 0) -> CompletionChunk:
        """The chunk that ends a choice, ``finish_reason`` set."""
        return self._chunk([CompletionChoice(index=index, text=text, finish_reason=reason)])

    def usage(self, usage: Usage) -> CompletionChunk:
        """The usage-only chunk sent last when ``include_usage`` was asked for."""
        return self._chunk([], usage=usage)

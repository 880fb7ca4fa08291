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
  own default or the server's (``meshd.api.sampling``).
* **Rejected when they ask for something we cannot do** (400, ``code``
  ``unsupported_parameter``): ``n`` other than 1, ``logprobs`` / ``top_logprobs``,
  non-empty ``tools`` / ``functions``, a ``response_format`` other than ``text``, and
  for completions ``echo: true``, ``best_of`` other than 1 and a non-empty ``suffix``.
  Each would change the shape or the meaning of the answer; answering without it
  would silently lie to the client. Their neutral values (``n: 1``, ``logprobs:
  false``, ``tools: []`` and so on) are accepted, because clients send defaults.
* **Ignored**: every other field, known to OpenAI (``user``, ``metadata``, ``store``,
  ``service_tier``, ``tool_choice``, ``parallel_tool_calls``, ...) or not. OpenAI
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

from meshd.engines.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    MAX_REPEAT_PENALTY,
)

__all__ = [
    "MAX_STOP_SEQUENCES",
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionRequest",
    "ChatDelta",
    "ChatMessage",
    "ChatStream",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionStream",
    "ContentPart",
    "ErrorDetail",
    "ErrorResponse",
    "FieldError",
    "FinishReason",
    "Model",
    "ModelList",
    "ResponseFormat",
    "Role",
    "StreamOptions",
    "Usage",
    "new_chat_completion_id",
    "new_completion_id",
    "unix_time",
]

#: Most stop sequences a request may carry (OpenAI's limit).
MAX_STOP_SEQUENCES = 4

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

Role = Literal["system", "user", "assistant", "developer", "tool"]
FinishReason = Literal["stop", "length"]


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


class FieldError(ValueError):
    """A request field broke a rule.

    ``param`` is the field's name relative to the Struct that raised (``"temperature"``,
    ``"content"``); the body parser prefixes the JSON path of that Struct. ``code`` is
    the OpenAI error code, ``None`` for a plain invalid value.
    """

    def __init__(self, param: str, reason: str, code: str | None = None) -> None:
        super().__init__(reason)
        self.param = param
        self.reason = reason
        self.code = code


def _unsupported(param: str, reason: str) -> FieldError:
    return FieldError(param, reason, code="unsupported_parameter")


def _check_range(
    name: str,
    value: float | None,
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
) -> None:
    if value is None:
        return
    # Written as "not (inside)" so that NaN fails too.
    inside = (lo < value if lo_open else lo <= value) and value <= hi
    if not inside:
        left = "(" if lo_open else "["
        raise FieldError(name, f"{name} must be in {left}{lo:g}, {hi:g}], got {value!r}")


def _check_min(name: str, value: int | None, lo: int) -> None:
    if value is not None and value < lo:
        raise FieldError(name, f"{name} must be >= {lo}, got {value}")


def _check_int64(req: msgspec.Struct) -> None:
    """Every integer field fits in a signed 64-bit integer.

    JSON integers have no bound and msgspec decodes them into Python ints, but the
    values travel on to the runners in msgpack, which cannot carry more: a ``top_k`` of
    2**70 must be a 400 here, not a failure to encode later.
    """
    for name in req.__struct_fields__:
        value = getattr(req, name)
        if type(value) is int and not _INT64_MIN <= value <= _INT64_MAX:
            raise FieldError(name, f"{name} must fit in a signed 64-bit integer, got {value}")


def _check_common(req: _GenerationRequest) -> None:
    """The rules every generation request shares, in one place."""
    # A blank name is no name: model resolution strips it and finds nothing to look up.
    if not req.model.strip():
        raise FieldError("model", "model must be a non-empty string")
    _check_int64(req)
    _check_min("max_tokens", req.max_tokens, 1)
    _check_range("temperature", req.temperature, 0.0, 2.0)
    _check_range("top_p", req.top_p, 0.0, 1.0, lo_open=True)
    _check_min("top_k", req.top_k, 0)
    stops = req.stop_sequences
    if len(stops) > MAX_STOP_SEQUENCES:
        raise FieldError(
            "stop", f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}"
        )
    if any(s == "" for s in stops):
        raise FieldError("stop", "stop sequences must be non-empty strings")
    if req.n is not None and req.n != 1:
        raise _unsupported("n", f"only n=1 is supported (one choice per request), got {req.n}")
    _check_range("presence_penalty", req.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    _check_range("frequency_penalty", req.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    _check_range("min_p", req.min_p, 0.0, 1.0)
    _check_range("repeat_penalty", req.repeat_penalty, 0.0, MAX_REPEAT_PENALTY, lo_open=True)
    _check_min("repeat_last_n", req.repeat_last_n, -1)
    _ = req.token_bias  # raises FieldError for a bad logit_bias


# ---------------------------------------------------------------------------------------
# requests


class StreamOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``stream_options``: only ``include_usage`` is honoured; other keys are ignored.

    Ignored as well when ``stream`` is false (OpenAI rejects that combination; nothing
    is lost by tolerating it).
    """

    include_usage: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``response_format``: only ``{"type": "text"}`` (the default) is supported."""

    type: str = "text"


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
    #: Only 1 (or absent) is accepted.
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


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` parts.

    ``type`` is a plain string (not a Literal) so that an image or audio part gets a
    message that says why, rather than a bare enum error.
    """

    type: str
    text: str | None = None

    def __post_init__(self) -> None:
        if self.type != "text":
            raise _unsupported(
                "type",
                f"content part type {self.type!r} is not supported; "
                "meshd serves text models (use type 'text')",
            )
        if self.text is None:
            raise FieldError("text", "a text content part needs a string `text`")


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message of a chat request.

    ``content`` may be ``None`` only for ``assistant`` messages (OpenAI allows it next
    to tool calls, which are ignored here). Tool-call fields and anything else on a
    message are ignored.
    """

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"content is required for role {self.role!r}")

    @property
    def text(self) -> str:
        """The content as one string: text parts joined by newlines, ``""`` for none."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_GenerationRequest, kw_only=True, omit_defaults=True):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    #: Newer name of ``max_tokens``; send either. Both must agree when both are sent.
    max_completion_tokens: int | None = None
    #: Only ``false`` (or absent) is accepted.
    logprobs: bool | None = None
    #: Only 0 (or absent) is accepted.
    top_logprobs: int | None = None
    #: Only ``{"type": "text"}`` (or absent) is accepted.
    response_format: ResponseFormat | None = None
    #: Only empty (or absent) is accepted; ``tool_choice`` is ignored.
    tools: list[dict[str, Any]] | None = None
    #: Deprecated form of ``tools``; only empty (or absent) is accepted.
    functions: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        _check_common(self)
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
        if self.logprobs:
            raise _unsupported("logprobs", "logprobs are not supported; send false or omit it")
        if self.top_logprobs:
            raise _unsupported("top_logprobs", "top_logprobs is not supported; omit it")
        if self.response_format is not None and self.response_format.type != "text":
            raise _unsupported(
                "response_format",
                f"response_format type {self.response_format.type!r} is not supported; "
                "only 'text' is",
            )
        if self.tools:
            raise _unsupported("tools", "tools (function calling) are not supported")
        if self.functions:
            raise _unsupported("functions", "functions (function calling) are not supported")

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
    #: Only absent/``null`` is accepted (log probabilities are not returned).
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
        if self.logprobs is not None:
            raise _unsupported("logprobs", "logprobs are not supported; omit it")
        if self.suffix:
            raise _unsupported("suffix", "suffix (insertion) is not supported")

    @property
    def prompt_text(self) -> str:
        """The single prompt as a string."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


# ---------------------------------------------------------------------------------------
# responses


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        """Usage with ``total_tokens`` computed."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class AssistantMessage(msgspec.Struct, kw_only=True):
    """The message of a non-streamed chat choice."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    """One choice of a :class:`ChatCompletion` (there is only ever index 0)."""

    index: int = 0
    message: AssistantMessage
    logprobs: None = None
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
    ) -> ChatCompletion:
        """The usual one-choice answer."""
        return cls(
            id=id or new_chat_completion_id(),
            created=unix_time() if created is None else created,
            model=model,
            choices=[
                ChatCompletionChoice(
                    message=AssistantMessage(content=content), finish_reason=finish_reason
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


class ChatCompletionChunkChoice(msgspec.Struct, kw_only=True):
    """One choice of a :class:`ChatCompletionChunk`."""

    index: int = 0
    delta: ChatDelta
    logprobs: None = None
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
    logprobs: None = None
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
    ) -> Completion:
        """The usual one-choice answer."""
        return cls(
            id=id or new_completion_id(),
            created=unix_time() if created is None else created,
            model=model,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
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

    def start(self) -> ChatCompletionChunk:
        """The first chunk: ``delta: {"role": "assistant", "content": ""}``."""
        return self._chunk(
            [ChatCompletionChunkChoice(delta=ChatDelta(role="assistant", content=""))]
        )

    def content(self, text: str) -> ChatCompletionChunk:
        """A chunk adding ``text`` to the message."""
        return self._chunk([ChatCompletionChunkChoice(delta=ChatDelta(content=text))])

    def finish(self, reason: FinishReason) -> ChatCompletionChunk:
        """The chunk that ends the choice: empty delta, ``finish_reason`` set."""
        return self._chunk([ChatCompletionChunkChoice(delta=ChatDelta(), finish_reason=reason)])

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

    def content(self, text: str) -> CompletionChunk:
        """A chunk adding ``text``."""
        return self._chunk([CompletionChoice(text=text)])

    def finish(self, reason: FinishReason, text: str = "") -> CompletionChunk:
        """The chunk that ends the choice, ``finish_reason`` set."""
        return self._chunk([CompletionChoice(text=text, finish_reason=reason)])

    def usage(self, usage: Usage) -> CompletionChunk:
        """The usage-only chunk sent last when ``include_usage`` was asked for."""
        return self._chunk([], usage=usage)

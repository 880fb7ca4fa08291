"""Ollama's HTTP schemas (``/api/...``): the request bodies as Structs (the answers:
``ollama_replies``).

Requests follow Ollama's own API documentation; every sampling knob lives in
``options``. Fields Ollama defines for its own model store or GPUs (``num_gpu``,
``num_thread``, ``use_mmap``, ``mirostat``, ...) are accepted and ignored, as Ollama
ignores options a model does not use. What would change the meaning of an answer and
cannot be done is a 400 naming the field: a custom ``template``, a ``suffix``
(fill-in-the-middle), ``context`` (the token ids of an earlier answer), and images
that are no base64 image (``images``: base64 files, read by the model's projector;
a model without one answers a 400 that says so). ``think``
(true, false, or gpt-oss's ``low``/``medium``/``high``) turns a thinking model's
thoughts on or off with the model's own switch; a model that does not think ignores
it. Thoughts come in ``message.thinking`` (chat) or ``thinking`` (generate).
Fields Ollama has no use for are ignored, as Ollama ignores them: unknown fields, and a
``tool_choice`` other than meshd's string extension (an object, as some clients send).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from meshd.domain.keepalive import parse_keep_alive
from meshd.domain.reasoning import ThinkChoice
from meshd.domain.sampling import MAX_TOP_LOGPROBS

from .images import image_bytes
from .rules import (
    MAX_TOOLS,
    FieldError,
    check_int64,
    check_min,
    check_range,
    check_sampling_fields,
    check_stops,
    schema_grammar,
    think_choice,
    unsupported,
)
from .schemas import Tool

__all__ = [
    "ChatRequest",
    "EmbedRequest",
    "EmbeddingsRequest",
    "GenerateRequest",
    "Message",
    "ModelRequest",
    "Options",
    "ToolCall",
    "ToolCallFunction",
]


class Options(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``options``: the sampling and length knobs meshd honours (the others are
    ignored). ``num_ctx`` is the context of the instance a request places (when none
    serves the model yet); an instance already placed keeps its own, since it serves
    every client alike."""

    num_ctx: int | None = None
    #: Tokens to generate at most; -1 (no limit) and -2 (fill the context) leave it to
    #: the node's cap (``meshd up --max-tokens``).
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    #: Extension: the exact mode, here too since the ``ollama`` client sends no
    #: field of its own making but passes ``options`` on (the body's own wins).
    exact: bool | None = None

    def __post_init__(self) -> None:
        check_int64(self)
        check_min("num_ctx", self.num_ctx, 1)
        check_sampling_fields(self)
        check_stops(self.stop or [])

    @property
    def max_tokens(self) -> int | None:
        """``num_predict`` as a cap (None: the node's own)."""
        return self.num_predict if self.num_predict and self.num_predict > 0 else None


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    #: The arguments as a JSON object (not text, unlike OpenAI).
    arguments: dict[str, Any] = {}


class ToolCall(msgspec.Struct, kw_only=True):
    function: ToolCallFunction


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message of a chat; a ``tool`` message answers the call ``tool_name`` names."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    #: An earlier answer's thoughts: given to the template (most drop past thoughts).
    thinking: str | None = None

    def __post_init__(self) -> None:
        for i, data in enumerate(self.images or ()):
            image_bytes(data, f"images[{i}]")  # checked here, where the error names it
        if self.tool_calls and self.role != "assistant":
            raise FieldError("tool_calls", "only assistant messages carry tool_calls")


def keep_alive_seconds(value: str | float | None) -> float | None:
    """``keep_alive`` in seconds (``math.inf``: forever; None: not said), or the
    FieldError that names it."""
    try:
        return parse_keep_alive(value)
    except ValueError as e:
        raise FieldError("keep_alive", str(e)) from None


def _check_generation(req: _Generation) -> None:
    if not req.model.strip():
        raise FieldError("model", "model is required")
    keep_alive_seconds(req.keep_alive)
    _ = req.think_choice  # a FieldError for a level no model knows
    check_range("top_logprobs", req.top_logprobs, 0, MAX_TOP_LOGPROBS)
    if req.format not in (None, "", "json") and not isinstance(req.format, dict):
        raise FieldError("format", "format is 'json' or a JSON Schema object")
    _ = req.grammar


class _Generation(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    #: ``"json"`` (any JSON) or a JSON Schema: the answer is constrained to it.
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    #: Streamed as NDJSON unless false (Ollama's default is to stream).
    stream: bool = True
    #: How long the model stays loaded after this request (seconds, or a duration such
    #: as ``"10m"``; 0 unloads it after; negative: forever), see :attr:`keep_alive_s`.
    keep_alive: str | float | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    #: Extension (every dialect): the exact mode, see ``schemas._GenerationRequest``;
    #: ``options.exact`` where absent.
    exact: bool | None = None

    @property
    def grammar(self) -> str | None:
        """The grammar the answer follows (None: free text); FieldError names format."""
        if self.format == "json":
            return schema_grammar(None, "format")
        if isinstance(self.format, dict):
            return schema_grammar(self.format, "format")
        return None

    @property
    def think_choice(self) -> ThinkChoice:
        """How the model should think (``think``: on or off, or gpt-oss's level)."""
        if isinstance(self.think, bool):
            return ThinkChoice(enabled=self.think)
        return think_choice(self.think or None, "think")

    @property
    def opts(self) -> Options:
        """``options``, empty when absent."""
        return self.options or _NO_OPTIONS

    @property
    def n_logprobs(self) -> int | None:
        """Alternatives to report per token; None: no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None


_NO_OPTIONS = Options()


class ChatRequest(_Generation, kw_only=True, omit_defaults=True):
    """Body of ``POST /api/chat``. No messages: the model is loaded, nothing generated."""

    messages: list[Message] = []
    tools: list[Tool] | None = None
    #: Extension (Ollama has none): ``auto`` (the default), ``none``, ``required`` or
    #: the name of the tool the model must call, as OpenAI's ``tool_choice``. Any other
    #: JSON (an object, as ollama-ai-provider-v2 sends) is ignored, as Ollama ignores it.
    tool_choice: Any = None

    def __post_init__(self) -> None:
        _check_generation(self)
        if self.tools and len(self.tools) > MAX_TOOLS:
            raise FieldError("tools", f"at most {MAX_TOOLS} tools, got {len(self.tools)}")
        if not isinstance(self.tool_choice, str):
            self.tool_choice = None
        names = {t.function.name for t in self.tools or ()}
        if self.tool_choice not in (None, "auto", "none", "required", *names):
            raise FieldError(
                "tool_choice",
                f"tool_choice is auto, none, required or a tool's name, got {self.tool_choice!r}",
            )
        if self.tool_choice == "required" and not self.tools:
            raise FieldError("tool_choice", "tool_choice 'required' needs tools")

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or ``none``), ``auto``, ``required`` or a tool's name."""
        if not self.tools or self.tool_choice == "none":
            return None
        return str(self.tool_choice or "auto")


class GenerateRequest(_Generation, kw_only=True, omit_defaults=True):
    """Body of ``POST /api/generate``. An empty prompt loads the model only.

    Without ``raw`` the prompt is a user turn through the model's chat template (after
    ``system``, when given); with ``raw: true`` it is sent as is.
    """

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None

    def __post_init__(self) -> None:
        _check_generation(self)
        if self.suffix:
            raise unsupported("suffix", "suffix (fill-in-the-middle) is not supported")
        if self.template:
            raise unsupported(
                "template", "a custom template is not supported: the model's own is used"
            )
        if self.context:
            raise unsupported(
                "context",
                "context (an earlier answer's token ids) is not supported; send the "
                "conversation to /api/chat instead",
            )
        for i, data in enumerate(self.images or ()):
            image_bytes(data, f"images[{i}]")
        if self.images and self.raw:
            raise unsupported("images", "images go with the model's template: not with raw: true")


class EmbedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Body of ``POST /api/embed``."""

    model: str
    input: str | list[str] = ""
    #: Accepted; an input over the context is an error either way (never silently cut).
    truncate: bool | None = None
    options: Options | None = None
    keep_alive: str | float | None = None
    dimensions: int | None = None

    @property
    def inputs(self) -> list[str]:
        """``input`` as a list."""
        return [self.input] if isinstance(self.input, str) else list(self.input)


class EmbeddingsRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Body of the older ``POST /api/embeddings``: one prompt."""

    model: str
    prompt: str = ""
    options: Options | None = None
    keep_alive: str | float | None = None


class ModelRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Body of ``/api/show``, ``/api/pull`` and ``/api/delete`` (``name`` is the older
    spelling of ``model``)."""

    model: str = ""
    name: str = ""
    stream: bool = True
    insecure: bool | None = None
    verbose: bool | None = None

    def __post_init__(self) -> None:
        if not (self.model or self.name).strip():
            raise FieldError("model", "model is required")

    @property
    def model_name(self) -> str:
        """The model named."""
        return (self.model or self.name).strip()

"""Ollama's HTTP answers (``/api/...``) as Structs: what a chat, a generation, an
embedding and the model routes (``tags``, ``ps``, ``show``) send back. The request
bodies are in ``ollama_schemas``."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from starlette.responses import Response

from .errors import ApiError
from .ollama_schemas import ToolCall
from .schemas import ChatTokenLogprob

__all__ = [
    "NDJSON",
    "AssistantMessage",
    "ChatResponse",
    "EmbedResponse",
    "EmbeddingsResponse",
    "GenerateResponse",
    "ModelDetails",
    "PsEntry",
    "PsResponse",
    "ShowResponse",
    "TagsEntry",
    "TagsResponse",
    "error_line",
    "json_response",
]


#: A streamed answer's media type: one JSON object per line.
NDJSON = "application/x-ndjson"


def json_response(obj: object) -> Response:
    """``obj`` as one JSON body."""
    return Response(msgspec.json.encode(obj), media_type="application/json")


def error_line(err: ApiError) -> bytes:
    """The last line of a stream that failed after it started, as Ollama writes it."""
    return msgspec.json.encode(err.body_in("ollama")) + b"\n"


class _Timings(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the last object of an answer carries: nanoseconds, measured on this node
    (see ``meshd.api.ollama``)."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[ChatTokenLogprob] | None = None


class AssistantMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A message of an answer (``content`` always present, ``""`` when empty)."""

    role: Literal["assistant"]
    content: str
    tool_calls: list[ToolCall] | None = None
    #: A thinking model's thoughts (absent when it did not think).
    thinking: str | None = None


class ChatResponse(_Timings, kw_only=True, omit_defaults=True):
    message: AssistantMessage


class GenerateResponse(_Timings, kw_only=True, omit_defaults=True):
    response: str
    thinking: str | None = None


class EmbedResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None


class EmbeddingsResponse(msgspec.Struct, kw_only=True):
    embedding: list[float]


class ModelDetails(msgspec.Struct, kw_only=True):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str = ""
    quantization_level: str = ""


class TagsEntry(msgspec.Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class TagsResponse(msgspec.Struct, kw_only=True):
    models: list[TagsEntry]


class PsEntry(msgspec.Struct, kw_only=True):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class PsResponse(msgspec.Struct, kw_only=True):
    models: list[PsEntry]


class ShowResponse(msgspec.Struct, kw_only=True):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str

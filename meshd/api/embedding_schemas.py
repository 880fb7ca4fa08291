"""The bodies of OpenAI's embeddings route (``POST /v1/embeddings``), checked on
decode as :mod:`.schemas` checks the others."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from .rules import INT64_MAX as _INT64_MAX
from .rules import FieldError
from .rules import check_min as _check_min

__all__ = [
    "MAX_EMBEDDING_INPUTS",
    "Embedding",
    "EmbeddingList",
    "EmbeddingRequest",
    "EmbeddingUsage",
]

#: Most inputs one embeddings request may carry (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Body of ``POST /v1/embeddings``: one input or a list of them, each text or token
    ids."""

    model: str
    #: A text, a list of texts, a list of token ids, or a list of such lists (one
    #: union msgspec cannot type: checked below).
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    #: Only the model's own width (OpenAI's shortening needs a model trained for it).
    dimensions: int | None = None
    user: str | None = None

    def __post_init__(self) -> None:
        x = self.input
        if isinstance(x, list) and not (
            all(isinstance(v, str) for v in x)
            or all(_is_token(v) for v in x)
            or all(isinstance(v, list) and all(_is_token(t) for t in v) for v in x)
        ):
            raise FieldError(
                "input", "input must be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids",
            )  # fmt: skip
        items = self.inputs
        if not items:
            raise FieldError("input", "input must hold at least one text or token list")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise FieldError("input", f"at most {MAX_EMBEDDING_INPUTS} inputs, got {len(items)}")
        for i, item in enumerate(items):
            if not item:
                raise FieldError("input", f"input {i} is empty")
            if isinstance(item, list) and any(t < 0 or t > _INT64_MAX for t in item):
                raise FieldError("input", f"input {i} holds a token id below 0")
        _check_min("dimensions", self.dimensions, 1)

    @property
    def inputs(self) -> list[str | list[int]]:
        """Every input, in order: a text, or a list of token ids."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and all(isinstance(v, int) for v in x):
            return [x]
        return list(x)


def _is_token(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Embedding(msgspec.Struct, kw_only=True):
    object: Literal["embedding"] = "embedding"
    index: int
    #: Floats, or (``encoding_format: base64``) the float32 little-endian bytes.
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    """Response of ``POST /v1/embeddings``."""

    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage

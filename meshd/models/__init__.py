"""Model knowledge: naming and resolving models, facts from their headers, content ids,
vocabularies and chat templates, layer-range slices. Reads files; starts no process.

| module | owns |
|---|---|
| ``defaults`` | the default model's name, its install line, the GGUF quantisation order |
| ``resolve`` | a name (alias, path, HF repo id) -> a file or folder on this machine |
| ``inventory`` | the names of every model this node holds (its card's ``models``) |
| ``gguf`` | GGUF headers (key/values, tensor descriptors) without loading the file |
| ``folder`` | MLX / Hugging Face model folders (config.json + safetensors) |
| ``facts`` | :class:`~meshd.crdt.views.ModelFacts`: what placement needs to know |
| ``hashing`` | sha256 content ids, cached per file change |
| ``mlx_layout`` | what MLX can load and under which mlx-lm names |
| ``vocab`` | Hugging Face ``tokenizer.json`` vocabularies |
| ``chat`` | chat templates, found and rendered |
| ``slicing`` | sub-GGUFs of a layer range (the cache) |
| ``slice_writer`` | a slice's bytes: header records copied but the few a range changes |
| ``convert`` | a GGUF written out as an MLX folder (tests, benchmarks) |
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .defaults import DEFAULT_MODEL

if TYPE_CHECKING:
    from .errors import ModelFormatError, UnsupportedModelError
    from .resolve import (
        AmbiguousModelError,
        ModelNotFoundError,
        ResolvedModel,
        canonical_name,
        local_models,
        pull_hint,
        resolve_model,
    )

__all__ = [
    "DEFAULT_MODEL",
    "AmbiguousModelError",
    "ModelFormatError",
    "ModelNotFoundError",
    "ResolvedModel",
    "UnsupportedModelError",
    "canonical_name",
    "local_models",
    "pull_hint",
    "resolve_model",
]

#: Loaded on first use: importing a submodule (``meshd.models.defaults`` for a command
#: line's parser) must not load msgspec and the resolver with it.
_LAZY = {"ModelFormatError": ".errors", "UnsupportedModelError": ".errors"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_LAZY.get(name, ".resolve"), __name__)
    return getattr(module, name)

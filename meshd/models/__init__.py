"""Model knowledge: naming and resolving models, facts from their headers, content ids,
vocabularies and chat templates, layer-range slices. Reads files; starts no process.

| module | owns |
|---|---|
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

from .errors import ModelFormatError, UnsupportedModelError
from .resolve import (
    DEFAULT_MODEL,
    AmbiguousModelError,
    ModelNotFoundError,
    ResolvedModel,
    canonical_name,
    local_models,
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
    "resolve_model",
]

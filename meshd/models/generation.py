"""The sampling a model's authors ship with it, read from the model's own files.

A GGUF may carry ``general.sampling.*`` keys (llama.cpp's converter writes them from
the model's ``generation_config.json``); an MLX folder carries that file itself. A
request that names no sampling field gets these values, field by field, before the
server's own defaults (``meshd.api.sampling``).

A value out of the range the sampler accepts is dropped (a model file is not trusted
to be sane), as is everything from a ``generation_config.json`` whose ``do_sample`` is
not true: Hugging Face itself ignores its temperature and top-p then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshd.domain.sampling import SamplingChoice, field_problem

__all__ = ["folder_sampling", "gguf_sampling"]

#: GGUF metadata key -> SamplingChoice field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n",
}

#: generation_config.json key -> SamplingChoice field.
_HF_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repeat_penalty",
}


def gguf_sampling(kv: dict[str, Any]) -> SamplingChoice | None:
    """The sampling defaults in a GGUF's metadata, or None when it has none."""
    return _defaults({field: kv.get(key) for key, field in _GGUF_KEYS.items()})


def folder_sampling(folder: Path) -> SamplingChoice | None:
    """The sampling defaults of a model folder's ``generation_config.json``, or None."""
    try:
        config = json.loads((Path(folder) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("do_sample") is not True:
        return None
    return _defaults({field: config.get(key) for key, field in _HF_KEYS.items()})


def _defaults(raw: dict[str, Any]) -> SamplingChoice | None:
    kept: dict[str, Any] = {}
    for k, v in raw.items():
        if k in _INTEGERS and isinstance(v, float) and v.is_integer():
            v = int(v)  # a count written as a float (40.0)
        elif k not in _INTEGERS and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if v is not None and field_problem(k, v) is None:
            kept[k] = v
    return SamplingChoice(**kept) if kept else None


#: The fields that are counts (a file may write them as floats).
_INTEGERS = ("top_k", "repeat_last_n")

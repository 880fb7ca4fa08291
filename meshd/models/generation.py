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
import math
from pathlib import Path
from typing import Any

from meshd.crdt.views import SamplingDefaults

__all__ = ["folder_sampling", "gguf_sampling"]

#: GGUF metadata key -> SamplingDefaults field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n",
}

#: generation_config.json key -> SamplingDefaults field.
_HF_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repeat_penalty",
}


def gguf_sampling(kv: dict[str, Any]) -> SamplingDefaults | None:
    """The sampling defaults in a GGUF's metadata, or None when it has none."""
    return _defaults({field: kv.get(key) for key, field in _GGUF_KEYS.items()})


def folder_sampling(folder: Path) -> SamplingDefaults | None:
    """The sampling defaults of a model folder's ``generation_config.json``, or None."""
    try:
        config = json.loads((Path(folder) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("do_sample") is not True:
        return None
    return _defaults({field: config.get(key) for key, field in _HF_KEYS.items()})


def _defaults(raw: dict[str, Any]) -> SamplingDefaults | None:
    kept = {k: v for k, v in raw.items() if _sane(k, v)}
    if not kept:
        return None
    for k in ("top_k", "repeat_last_n"):
        if k in kept:
            kept[k] = int(kept[k])
    for k in ("temperature", "top_p", "min_p", "repeat_penalty"):
        if k in kept:
            kept[k] = float(kept[k])
    return SamplingDefaults(**kept)


#: field -> (low, high) accepted, inclusive.
_RANGES = {
    "temperature": (0.0, 2.0),
    "top_k": (0, 1 << 31),
    "top_p": (1e-9, 1.0),
    "min_p": (0.0, 1.0),
    "repeat_penalty": (1e-9, 10.0),
    "repeat_last_n": (-1, 1 << 31),
}


def _sane(field: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if not math.isfinite(value):
        return False
    if field in ("top_k", "repeat_last_n") and value != int(value):
        return False
    lo, hi = _RANGES[field]
    return lo <= value <= hi

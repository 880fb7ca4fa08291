"""What llama.cpp's graph does to the rows a stage is given, and which of its layers
attend through a sliding window: the two things a cut changes for some architectures.

* **Input scaling.** Some graphs multiply the input rows by a constant right after the
  embedding lookup, whether the rows are token embeddings or rows handed over by the
  stage before (``build_inp_embd`` applies ``{arch}.embedding_scale``; Gemma and Gemma 2
  scale by sqrt(hidden) unconditionally). A later stage would scale hidden rows that
  were scaled already, so it divides them first (:func:`input_scale`); Gemma 3 scales
  token inputs only and needs nothing.
* **Defaults from the layer count.** MiniCPM's residual scale defaults to
  1.4 / sqrt(block_count): a slice has fewer blocks, so it states the whole model's
  value (:func:`layer_count_defaults`).
* **Counts from the model's ends.** DeepSeek 2/3 and GLM-4.5 make their first
  ``{arch}.leading_dense_block_count`` layers dense (the rest MoE), and GLM-4.5 keeps its
  last ``{arch}.nextn_predict_layers`` for multi-token prediction, out of the graph. A
  slice states how many of its own layers are each (:func:`range_counts`).
* **Rows in need of M-RoPE positions.** GLM-4 and GLM-4.5's graphs abort on input rows
  (not token ids) unless the file gives multimodal rope sections ("This GGUF does not
  support multimodal"). A slice after the first states sections (:func:`hidden_rope_sections`):
  llama.cpp then rotates by M-RoPE, which, every section given the token's one position
  (what :class:`~meshd.engines.llama_stage.LlamaStage` passes), is the model's own
  NEOX rotation, computed in the same order.
* **Sliding-window layers.** Gemma 2/3 tell which layers use the window by a pattern
  over the layer index (every 2nd, every 6th is global). A slice renumbers its layers
  from 0, so the slice carries the range's own per-layer flags as an array, which
  llama.cpp reads instead of the pattern (:func:`swa_layers`).

Pure functions of a GGUF's metadata (as :func:`~meshd.models.gguf.read_metadata` gives).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "DEFAULT_EMBEDDING_SCALE",
    "SWA_PATTERN",
    "hidden_rope_sections",
    "input_scale",
    "layer_count_defaults",
    "range_counts",
    "swa_layers",
]

#: ``f_embedding_scale`` llama.cpp assumes when the file does not say (0: none).
DEFAULT_EMBEDDING_SCALE = {"minicpm": 12.0, "grok": 78.38367176906169}
#: Architectures whose graph scales every input by sqrt(hidden), hidden rows included.
_SQRT_HIDDEN = frozenset({"gemma", "gemma2"})
#: Sliding-window pattern llama.cpp assumes when the file gives none: a layer ``il`` is
#: windowed when ``il % n < n - 1`` (the last of every ``n`` is global).
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}


def input_scale(meta: Mapping[str, Any], arch: str) -> float:
    """The factor llama.cpp's graph multiplies a stage's input rows by (1.0: none)."""
    scale = meta.get(f"{arch}.embedding_scale")
    if not isinstance(scale, int | float):
        scale = DEFAULT_EMBEDDING_SCALE.get(arch, 0.0)
    out = float(scale) if scale else 1.0
    if arch in _SQRT_HIDDEN:
        out *= float(math.sqrt(int(meta.get(f"{arch}.embedding_length", 1))))
    return out


def swa_layers(meta: Mapping[str, Any], arch: str, n_layers: int) -> list[bool] | None:
    """Per layer of the whole model, whether it attends through the sliding window;
    None for an architecture with no such pattern (or a file that gives it per layer
    already, which a slice cuts like any per-layer array)."""
    if arch not in SWA_PATTERN:
        return None
    if arch == "gemma3" and not meta.get(f"{arch}.attention.sliding_window"):
        return None  # no window at all: llama.cpp runs every layer dense
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", SWA_PATTERN[arch])
    if isinstance(pattern, list):
        return None
    n = int(pattern)
    return [n == 0 or il % n < n - 1 for il in range(n_layers)]


def layer_count_defaults(meta: Mapping[str, Any], arch: str, n_layers: int) -> dict[str, float]:
    """Keys the file leaves out whose default llama.cpp derives from the layer count:
    a slice must state the whole model's value (float32 keys)."""
    out: dict[str, float] = {}
    if arch == "minicpm" and f"{arch}.residual_scale" not in meta:
        out[f"{arch}.residual_scale"] = 1.4 / math.sqrt(n_layers)
    return out


def range_counts(
    meta: Mapping[str, Any], arch: str, n_layers: int, start: int, end: int
) -> dict[str, int]:
    """Keys that count layers from the model's first or last one, as the slice of layers
    ``[start, end)`` states them (uint32 keys; only those the file has)."""
    out: dict[str, int] = {}
    lead = meta.get(f"{arch}.leading_dense_block_count")
    if isinstance(lead, int):
        out[f"{arch}.leading_dense_block_count"] = min(max(lead - start, 0), end - start)
    nextn = meta.get(f"{arch}.nextn_predict_layers")
    if isinstance(nextn, int):
        out[f"{arch}.nextn_predict_layers"] = max(0, end - max(start, n_layers - nextn))
    return out


#: Architectures whose llama.cpp graph takes hidden rows only with M-RoPE sections.
_MROPE_FOR_ROWS = frozenset({"glm4", "glm4moe"})


def hidden_rope_sections(meta: Mapping[str, Any], arch: str, start: int) -> list[int] | None:
    """``{arch}.rope.dimension_sections`` a slice from layer ``start`` states so that
    llama.cpp takes hidden rows in; None when it needs none (a first slice, which takes
    token ids; a file with sections of its own; another architecture)."""
    if start == 0 or arch not in _MROPE_FOR_ROWS:
        return None
    if f"{arch}.rope.dimension_sections" in meta:
        return None
    # Any two positive sections switch M-RoPE on; with one position in all of them the
    # rotation is the same whatever their widths.
    return [1, 1, 0, 0]

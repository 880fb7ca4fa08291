"""How a model turns the hidden states of an input into one embedding vector.

llama.cpp reads a pooling type from the GGUF (``{arch}.pooling_type``: BERT-style
embedding models say mean or CLS, decoder embedding models often last). A generative
model says none; OpenAI's endpoint needs one vector per input, so it is pooled by the
mean, as sentence-transformers does by default. The vector is then L2-normalised,
as OpenAI's embeddings are (cosine similarity is a dot product).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from .gguf import is_gguf, read_metadata

__all__ = ["Pooling", "pool", "pooling_of"]

Pooling = Literal["mean", "cls", "last"]

# llama.cpp's enum llama_pooling_type (none = 0 and rank = 4 have no single vector).
_BY_ID: dict[int, Pooling] = {1: "mean", 2: "cls", 3: "last"}


def pooling_of(path: Path | str) -> Pooling:
    """The pooling of the model at ``path`` (a GGUF or an MLX folder): its own when
    its GGUF names one, else mean."""
    path = Path(path)
    if not path.is_file() or not is_gguf(path):
        return "mean"
    arch = read_metadata(path, keys=["general.architecture"]).get("general.architecture")
    key = f"{arch}.pooling_type"
    value = read_metadata(path, keys=[key]).get(key)
    return _BY_ID.get(value, "mean") if isinstance(value, int) else "mean"


def pool(rows: npt.NDArray[np.float32], how: Pooling) -> npt.NDArray[np.float32]:
    """One unit-length vector from the final hidden states ``rows`` (n, hidden) of one
    input (a zero vector stays zero)."""
    if rows.ndim != 2 or len(rows) == 0:
        raise ValueError(f"pooling needs a non-empty (n, hidden) array, got {rows.shape}")
    if how == "cls":
        v = rows[0]
    elif how == "last":
        v = rows[-1]
    else:
        v = rows.mean(axis=0, dtype=np.float64)
    v = np.asarray(v, np.float64)
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).astype(np.float32)

"""safetensors headers: each tensor's dtype, shape and place in its file, read without
its data (a model folder's facts and slices need only these)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from .errors import ModelFormatError

__all__ = ["read_safetensors_header"]

#: Largest safetensors JSON header read (the format's own limit is 100 MB).
_MAX_HEADER = 100 << 20


def read_safetensors_header(file: Path | str) -> dict[str, dict[str, Any]]:
    """Tensor name -> ``{"dtype", "shape", "data_offsets"}`` from a safetensors file's
    JSON header (8-byte little-endian length, then JSON); no tensor data is read."""
    file = Path(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelFormatError(f"{file}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ModelFormatError(f"{file}: not a safetensors file (header of {n} bytes)")
        text = f.read(n)
    try:
        header = json.loads(text)
    except ValueError as e:
        raise ModelFormatError(f"{file}: not a safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise ModelFormatError(f"{file}: not a safetensors file")
    header.pop("__metadata__", None)
    return header

"""Activation rows on the wire: float32 by default, f16 or bf16 on a negotiated hop.

Every engine computes in float32 at the stage boundary; the narrower types only change
what crosses the network (half the bytes). bf16 has no numpy type, so it travels as
the top 16 bits of each float32 (viewed as uint16), rounded to nearest even, and comes
back exactly as ``mx.bfloat16`` or ``torch.bfloat16`` would have rounded it.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from .dtypes import ACTIVATION_DTYPES

__all__ = ["ACTIVATION_DTYPES", "TensorError", "decode_rows", "encode_rows", "itemsize"]

_ITEMSIZE: Final = {"f32": 4, "f16": 2, "bf16": 2}


class TensorError(ValueError):
    """A tensor frame that does not match its header (type, size)."""


def itemsize(dtype: str) -> int:
    """Bytes per element of wire type ``dtype``."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise TensorError(f"unknown activation dtype {dtype!r}") from None


def encode_rows(rows: npt.NDArray[np.float32], dtype: str) -> npt.NDArray:
    """float32 rows -> a contiguous array whose bytes are the wire frame."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if dtype == "f32":
        return rows
    if dtype == "f16":
        return rows.astype(np.float16)
    if dtype == "bf16":
        u = rows.view(np.uint32)
        # Round to nearest even on the dropped 16 bits; NaNs stay NaN (quiet bit set).
        rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
        nan = np.isnan(rows)
        if nan.any():
            rounded = np.where(nan, (u >> 16) | np.uint32(0x0040), rounded)
        return rounded.astype(np.uint16)
    raise TensorError(f"unknown activation dtype {dtype!r}")


def decode_rows(
    buf: memoryview | bytes, dtype: str, rows: int, hidden: int
) -> npt.NDArray[np.float32]:
    """A wire frame -> float32 rows ``(rows, hidden)``; :class:`TensorError` when the
    frame's size does not match the header."""
    size = itemsize(dtype)
    if rows < 0 or hidden < 1 or len(buf) != rows * hidden * size:
        raise TensorError(f"frame of {len(buf)} bytes for {rows} x {hidden} {dtype} rows")
    if dtype == "f32":
        return np.frombuffer(buf, np.float32).reshape(rows, hidden)
    if dtype == "f16":
        return np.frombuffer(buf, np.float16).astype(np.float32).reshape(rows, hidden)
    u = np.frombuffer(buf, np.uint16).astype(np.uint32) << 16
    return u.view(np.float32).reshape(rows, hidden)

"""GGUF tensors as MLX arrays for the types ``mx.load`` reads wrong or not at all.

``mx.load`` reads F32/F16/BF16, Q4_0, Q4_1, Q8_0 and Q6_K correctly, loads Q4_K with
wrong values and fails on Q5_0, Q2_K, Q3_K, IQ4_NL... (ENGINE-NOTES). A GGUF holding any
of those is read here instead: memory-mapped, only the tensors a stage keeps, each
turned into what an MLX stage loads (the names ``mx.load`` gives:
``x.weight`` packed ``uint32`` plus ``x.scales`` / ``x.biases`` in float32 for an
MLX affine-quantized matrix, always in groups of 32, or a plain array).

Per GGUF type (``EXACT_BITS`` / ``REQUANT_BITS``):

- Exact (no new error): types whose blocks are affine on groups of 32 values, ``v =
  scale * q + bias`` with integer ``q`` (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K).
  Their ``q`` are repacked with the block's own scale and offset at the same bit width,
  so MLX multiplies by exactly llama.cpp's dequantized values (Q4_K: 4 bits plus a
  float32 scale and offset per 32 values, 6 bits a weight against the file's 4.5).
- Re-quantized: types whose scales cover 16 values (Q6_K, Q3_K, Q2_K) or whose grid is
  not affine (IQ4_NL, IQ4_XS, the IQ1/IQ2/IQ3 grids, ternary and FP4 types) are
  dequantized by gguf-py and quantized again with ``mx.quantize`` (affine, group 32)
  at a width chosen to keep the added error well under the file's own: 8 bits for
  Q6_K, 6 bits for every type of about 4 bits or less. Measured on a 2-layer,
  256-wide synthetic llama quantized by llama.cpp (``tests/engines/test_mlx_kquants.py``):
  the re-quantization adds an RMS weight error of 0.27x (Q6_K, 8 bits), 0.24x
  (IQ4_NL, 6 bits), 0.11x (Q3_K) and 0.06x (Q2_K) the file's own error against the
  F32 weights. Whole-model logits (top ~95) then differ from llama.cpp's on the same
  file by 1.6 (Q3_K_M) and 2.0 (IQ4_NL), against 0.8-0.9 for the exact Q4_K_M/Q5_K_M
  (llama.cpp's int8 rounding of activations) and 7-14 between the file and its F32
  source; 8 bits would give 0.7-0.9 at a third more memory, 4 bits 6.3-7.7.
- F32, F16 and BF16 tensors come as they are.

Any other type (F64, integer tensors, Q8_1/Q8_K, types gguf-py does not know) is not
in ``DEQUANT_TYPES``: the header check refuses it before anything is read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .errors import ModelFormatError
from .gguf import read_header
from .quant_types import DEQUANT_TYPES, EXACT_BITS, GROUP_SIZE, REQUANT_BITS

# ``gguf`` is imported in the functions that use it: the package brings yaml and its
# readers (~0.1 s), which every node would pay at start for DEQUANT_TYPES alone.

__all__ = [
    "DEQUANT_TYPES",
    "EXACT_BITS",
    "GROUP_SIZE",
    "REQUANT_BITS",
    "TensorInfo",
    "affine_blocks",
    "load_tensors",
    "pack_bits",
    "tensor_infos",
    "to_mlx",
]


class TensorInfo(NamedTuple):
    """One tensor of a GGUF file: its type, numpy shape (rows first) and bytes."""

    type_name: str  # GGUF type name: F32, Q4_K, IQ4_NL...
    shape: tuple[int, ...]  # numpy order: the reverse of ggml's ne
    start: int  # byte offset of its data in the file
    size: int  # bytes of its data

    def raw(self, data: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
        """Its bytes in ``data``, the whole file (``np.memmap(path, np.uint8)``)."""
        return data[self.start : self.start + self.size]


def _f16(col: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """Two bytes per row (a block's f16 field) as float32, shape ``(n, 1)``."""
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


def affine_blocks(
    blocks: npt.NDArray[np.uint8], type_name: str
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Scale and offset of every 32-value group of an exact type's raw blocks
    (``(n_blocks, type_size)`` bytes): float32 arrays ``(n_blocks, groups_per_block)``
    with ``value = scale * q + offset`` for the group's integer ``q``."""
    import gguf

    if type_name in ("Q4_0", "Q5_0", "Q8_0"):
        # Symmetric: q is stored with a fixed offset (8, 16, 128 for int8 made unsigned).
        d = _f16(blocks[:, :2])
        zero = {"Q4_0": 8.0, "Q5_0": 16.0, "Q8_0": 128.0}[type_name]
        return d, -zero * d
    if type_name in ("Q4_1", "Q5_1"):
        return _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    if type_name in ("Q4_K", "Q5_K"):
        # A 256-value super-block: f16 d and dmin, then 8 six-bit scales and mins.
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
    raise ValueError(f"{type_name} is not an affine 32-value GGUF type")


def pack_bits(q: npt.NDArray[np.uint8], bits: int) -> npt.NDArray[np.uint32]:
    """MLX's packing of ``bits``-wide integers: each row a little-endian bit stream
    (value ``j`` in bits ``[j * bits, (j + 1) * bits)``), read as uint32 words."""
    rows, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q).view(np.uint32)
    if bits == 4:
        pairs = q.reshape(rows, cols // 2, 2)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4)).view(np.uint32)
    # 5 (and any other) bits: spell the stream out bit by bit.
    stream = np.unpackbits(q[..., None], axis=-1, count=bits, bitorder="little")
    packed = np.packbits(stream.reshape(rows, cols * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view(np.uint32)


def _exact(
    raw: npt.NDArray[np.uint8], type_name: str, rows: int, cols: int
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """An exact type's packed weight, scales and offsets for MLX."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, type_size)
    scale, offset = affine_blocks(blocks, type_name)
    # The integers back from gguf-py's dequantized values (which are llama.cpp's
    # scale * q + offset in float32): rounding undoes the float error exactly, and
    # saves re-implementing each type's bit layout.
    values = gguf.quants.dequantize(raw, qtype).reshape(scale.shape[0], -1, GROUP_SIZE)
    s, o = scale[..., None], offset[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s != 0, np.rint((values - o) / s), 0.0)
    bits = EXACT_BITS[type_name]
    q8 = np.clip(q, 0, (1 << bits) - 1).astype(np.uint8).reshape(rows, cols)
    groups = cols // GROUP_SIZE
    return pack_bits(q8, bits), scale.reshape(rows, groups), offset.reshape(rows, groups)


def to_mlx(
    raw: npt.NDArray[np.uint8], type_name: str, shape: tuple[int, ...], name: str
) -> dict[str, Any]:
    """One GGUF tensor (its ``raw`` bytes, type and numpy ``shape``, rows first) as
    MLX arrays named as ``mx.load`` names them: ``{name: array}`` for a plain tensor,
    ``{base.weight, base.scales, base.biases}`` for a quantized matrix (``name`` ends
    in ``.weight``)."""
    import gguf
    import mlx.core as mx

    if type_name not in DEQUANT_TYPES:
        raise ModelFormatError(f"{name}: GGUF type {type_name} cannot be read for MLX")
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("F32", "F16"):
        dtype = np.float32 if type_name == "F32" else np.float16
        return {name: mx.array(raw.view(dtype).reshape(shape))}
    if type_name == "BF16":
        # No numpy bfloat16: through float32 (exact), to the dtype mx.load gives it.
        values = gguf.quants.dequantize(raw, qtype).reshape(shape)
        return {name: mx.array(values).astype(mx.bfloat16)}
    if len(shape) != 2 or shape[1] % GROUP_SIZE or not name.endswith(".weight"):
        raise ModelFormatError(f"{name}: a {type_name} tensor of shape {shape} is no matrix")
    base = name[: -len(".weight")]
    rows, cols = shape
    if type_name in EXACT_BITS:
        packed, scales, biases = _exact(raw, type_name, rows, cols)
        w, s, b = mx.array(packed), mx.array(scales), mx.array(biases)
    else:
        values = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
        w, s, b = mx.quantize(mx.array(values), group_size=GROUP_SIZE, bits=REQUANT_BITS[type_name])
    return {f"{base}.weight": w, f"{base}.scales": s, f"{base}.biases": b}


def tensor_infos(path: Path | str) -> dict[str, TensorInfo]:
    """Where each tensor of a GGUF lies: name -> :class:`TensorInfo`, from the
    project's own header reader (:func:`meshd.models.gguf.read_header`, milliseconds
    where ``gguf.GGUFReader`` spends seconds on a large vocabulary). Raises
    ModelFormatError for a file that is no GGUF, is cut short or holds a tensor of a
    type this gguf package does not know, FileNotFoundError for a missing one.
    """
    import gguf

    path = Path(path)
    header = read_header(path)
    file_size = path.stat().st_size
    out: dict[str, TensorInfo] = {}
    for name, (type_name, ne) in header.tensors.items():
        if type_name not in gguf.GGMLQuantizationType.__members__:
            raise ModelFormatError(f"{path}: {name} has an unknown GGUF {type_name}")
        start, size = header.offsets[name], header.nbytes[name]
        if start + size > file_size:
            raise ModelFormatError(f"{path}: {name} runs past the end of the file")
        # ne[0] (the row width) first in GGUF; numpy shapes are the reverse.
        out[name] = TensorInfo(type_name, tuple(reversed(ne)), start, size)
    return out


def load_tensors(path: Path | str, keep: Callable[[str], bool]) -> dict[str, Any]:
    """The tensors of the GGUF at ``path`` whose names ``keep`` accepts, as MLX arrays
    (see :func:`to_mlx`); the others are never read (the file is memory-mapped).

    Each tensor is evaluated as it is made, so at most one tensor's float32 copy is
    alive at a time besides the results.
    """
    import mlx.core as mx

    infos = tensor_infos(path)
    data = np.memmap(path, np.uint8, mode="r")
    out: dict[str, Any] = {}
    for name, info in infos.items():
        if not keep(name):
            continue
        arrays = to_mlx(info.raw(data), info.type_name, info.shape, name)
        # mx.array copied the bytes; evaluating now frees this tensor's float32
        # copy (a re-quantized type) before the next one is made.
        mx.eval(list(arrays.values()))
        out.update(arrays)
    return out

"""The bytes of a layer-range slice of a GGUF: the source's header records copied as they
are (the vocabulary with them) but the few a range changes, its tensors renamed, their
data copied from a memory map.

Written by hand rather than through ``gguf.GGUFReader``/``GGUFWriter``: the reader builds
a numpy view of every vocabulary string (8 s on the default model's 49k tokens on a
2-core machine, far more on a 150k one) only for the writer to encode each again. Here
the header costs a scan and the data a copy. The layout is GGUF v2/v3's: header, records,
tensor descriptors, padding to ``general.alignment``, each tensor's data aligned.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from .errors import ModelFormatError
from .gguf import GGUF_MAGIC, KvRecord, encode_kv, read_header, read_kv_records
from .scaling import hidden_rope_sections, layer_count_defaults, range_counts, swa_layers

__all__ = ["UNBOUNDED_WINDOW", "layer_count", "write_slice"]

_BLK = re.compile(r"^blk\.(\d+)\.(.*)$")
#: A sliding window wider than any context (positions are int32 in llama.cpp).
UNBOUNDED_WINDOW = 1 << 24
#: GGUF value types the records written here take.
_ARRAY, _BOOL, _UINT32, _INT32, _FLOAT32 = 9, 7, 4, 5, 6


def layer_count(meta: Mapping[str, Any], path: Path | str) -> tuple[str, int]:
    """The architecture and block count a header's key/values state (ModelFormatError
    without)."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFormatError(f"{path}: GGUF metadata lacks general.architecture")
    n = meta.get(f"{arch}.block_count")
    if not isinstance(n, int):
        raise ModelFormatError(f"{path}: GGUF metadata lacks '{arch}.block_count'")
    return arch, n


def write_slice(src: Path, out: Path, start: int, end: int) -> None:
    """Write the slice of layers ``[start, end)`` of ``src`` to ``out`` (see
    :mod:`meshd.models.slicing` for what a slice holds)."""
    order, version, records = read_kv_records(src)
    arch, n_layers = layer_count({r.key: r.value for r in records}, src)
    kv = _records(order, records, arch, n_layers, start, end)
    header = read_header(src)
    align = header.kv.get("general.alignment") or 32
    kept = [(name, new) for name in header.tensors if (new := _renamed(name, start, end))]
    infos, offset = [], 0
    for name, new in kept:
        offset = _aligned(offset, align)
        _, shape = header.tensors[name]
        infos.append(_tensor_info(order, new, shape, _type_id(header.tensors[name][0]), offset))
        offset += header.nbytes[name]
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        view = memoryview(buf)
        try:
            with open(out, "wb") as w:
                w.write(GGUF_MAGIC + struct.pack(order + "IQQ", version, len(kept), len(kv)))
                for chunk in (*kv, *infos):
                    w.write(chunk)
                _pad(w, align)
                for name, _ in kept:
                    at, n = header.offsets[name], header.nbytes[name]
                    if at + n > len(buf):
                        raise ModelFormatError(f"{src}: tensor {name[:80]!r} runs past the end")
                    w.write(view[at : at + n])
                    _pad(w, align)
        finally:
            view.release()


def _records(
    order: str, records: list[KvRecord], arch: str, n_layers: int, start: int, end: int
) -> list[bytes]:
    """The slice's header records: the source's, but the block count, per-layer arrays
    and sliding-window pattern of the range, the defaults the layer count sets, and
    rope sections where llama.cpp takes hidden rows only with them."""
    meta = {r.key: r.value for r in records}
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    window_key = f"{arch}.attention.sliding_window"
    swa = swa_layers(meta, arch, n_layers)
    flags = swa[start:end] if swa is not None else None
    # A range of global layers only: llama.cpp's graph for these architectures needs a
    # windowed layer, so the slice windows them all by more than any context can hold
    # (the same attention as none).
    unwindowed = flags is not None and not any(flags)
    counts = range_counts(meta, arch, n_layers, start, end)
    out = []
    for r in records:
        if (flags is not None and r.key == pattern_key) or (unwindowed and r.key == window_key):
            continue  # written below, as the range's own
        if r.key in counts:
            out.append(encode_kv(order, r.key, r.kind, counts[r.key]))
            continue
        out.append(_record(order, r, arch, n_layers, start, end))
    for key, value in layer_count_defaults(meta, arch, n_layers).items():
        out.append(encode_kv(order, key, _FLOAT32, value))
    if flags is not None:
        # Layer il of the slice is layer start + il of the model: a pattern over the
        # slice's own indices would window the wrong layers once start is not a multiple.
        if unwindowed:
            flags = [True] * len(flags)
            out.append(encode_kv(order, window_key, _UINT32, UNBOUNDED_WINDOW))
        out.append(encode_kv(order, pattern_key, _ARRAY, flags, _BOOL))
    sections = hidden_rope_sections(meta, arch, start)
    if sections is not None:
        key = f"{arch}.rope.dimension_sections"
        out.append(encode_kv(order, key, _ARRAY, sections, _INT32))
    return out


def _record(order: str, r: KvRecord, arch: str, n_layers: int, start: int, end: int) -> bytes:
    if r.key == f"{arch}.block_count":
        return encode_kv(order, r.key, r.kind, end - start)
    per_layer = r.kind == _ARRAY and isinstance(r.value, list) and len(r.value) == n_layers
    if per_layer and r.key.startswith(f"{arch}."):
        # Per-layer hyperparameters (head counts, sliding-window patterns of some
        # architectures) are arrays of block_count entries: keep the range's own.
        return encode_kv(order, r.key, r.kind, r.value[start:end], r.item)
    return r.raw


def _renamed(name: str, start: int, end: int) -> str | None:
    """The tensor's name in the slice, or None when it belongs to another range."""
    m = _BLK.match(name)
    if m is None:
        # Global tensors (token_embd, output_norm, output, rope_freqs, ...): every
        # slice needs them for llama.cpp to load it.
        return name
    i = int(m.group(1))
    if start <= i < end:
        return f"blk.{i - start}.{m.group(2)}"
    return None


def _type_id(type_name: str) -> int:
    """The GGML type id of a type as :func:`read_header` names it (``type N`` for one
    newer than the gguf package)."""
    if type_name.startswith("type "):
        return int(type_name.split()[1])
    import gguf  # here: the package brings yaml and its readers (~0.1 s) to a node's start

    return int(gguf.GGMLQuantizationType[type_name].value)


def _tensor_info(order: str, name: str, shape: tuple[int, ...], kind: int, offset: int) -> bytes:
    b = name.encode()
    dims = struct.pack(f"{order}I{len(shape)}Q", len(shape), *shape)
    return struct.pack(order + "Q", len(b)) + b + dims + struct.pack(order + "IQ", kind, offset)


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _pad(w: BinaryIO, align: int) -> None:
    w.write(b"\0" * (_aligned(w.tell(), align) - w.tell()))

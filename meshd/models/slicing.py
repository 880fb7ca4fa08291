"""Cut a GGUF model into a sub-GGUF holding one contiguous range of layers.

Stock llama.cpp cannot run a layer range of a full file (``kv_overrides`` cannot
shrink ``block_count``: "wrong number of tensors"), so a llama.cpp stage loads a
slice instead: blocks ``[start, end)`` renamed to ``blk.0 ..``, quantized bytes
copied as they are, ``block_count`` set to the range's length and every other piece
of metadata kept. llama.cpp demands ``token_embd.weight`` and ``output_norm.weight``
in every file, so each slice carries them (and ``output.weight`` where present): the
first stage embeds, the last one normalizes and projects, the others ignore them.

Slices are cached on disk under ``out_dir/<sha256[:16]>/<start>-<end>.gguf``; a slice
is written to a temporary file and renamed into place, so a reader never sees half a
slice and two processes cutting the same one at once both end with a whole file.
The cache is bounded by :func:`trim_slices`: slices no stage uses are deleted, least
recently used first, while the cache is over its quota (a slice's mtime is its last use).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Collection
from pathlib import Path

import gguf

from meshd.domain.facts import is_sha256

from .atomic import written_whole
from .errors import ModelFormatError
from .gguf import architecture, open_gguf, read_metadata
from .scaling import layer_count_defaults, swa_layers

__all__ = ["cache_folder", "slice_gguf", "slice_path", "trim_slices"]

_BLK = re.compile(r"^blk\.(\d+)\.(.*)$")
#: A sliding window wider than any context (positions are int32 in llama.cpp).
UNBOUNDED_WINDOW = 1 << 24


def slice_path(out_dir: Path, sha256: str, start: int, end: int) -> Path:
    """Where the slice ``[start, end)`` of the model with this sha256 is cached."""
    return Path(out_dir) / cache_folder(sha256) / f"{start}-{end}.gguf"


def cache_folder(sha256: str) -> str:
    """The cache folder of a model's slices: its sha256's first 16 digits. A value
    that is not a sha256 (it came from a plan, a peer's card) never names a path:
    ValueError."""
    if not is_sha256(sha256):
        raise ValueError(f"not a sha256: {sha256[:80]!r}")
    return sha256[:16]


def slice_gguf(src: Path, start: int, end: int, out_dir: Path, sha256: str) -> Path:
    """Path of a GGUF holding layers ``[start, end)`` of ``src``, cutting it if needed.

    ``sha256`` is the source file's hash (see ``gguf_facts.file_sha256``); it names
    the cache folder so that two files with the same name never share slices. The
    whole range ``[0, n_layers)`` returns ``src`` itself. A cached slice is returned
    as it is, without reading ``src`` again. Raises ValueError for an empty or out of
    bounds range and ModelFormatError for a file that is not a GGUF model.
    """
    src = Path(src)
    if start < 0 or end <= start:
        raise ValueError(f"bad layer range [{start}, {end})")
    dest = slice_path(out_dir, sha256, start, end)
    if dest.is_file():
        # Only ever renamed into place whole, so existing means complete. Touched: the
        # cache quota evicts the slices used least recently.
        with contextlib.suppress(OSError):
            os.utime(dest)
        return dest

    # The whole range is the source itself: answer from the header alone (gguf-py's
    # reader parses the whole vocabulary, seconds on a big one).
    meta = read_metadata(src)
    n_total = meta.get(f"{meta.get('general.architecture', '')}.block_count")
    if start == 0 and isinstance(n_total, int) and end == n_total:
        return src

    reader = open_gguf(src)
    arch = architecture(reader, src)
    count_key = f"{arch}.block_count"
    field = reader.fields.get(count_key)
    if field is None:
        raise ModelFormatError(f"{src}: GGUF metadata lacks {count_key!r}")
    n_layers = int(field.contents())
    if end > n_layers:
        raise ValueError(f"layer range [{start}, {end}) is outside the model's {n_layers}")
    if start == 0 and end == n_layers:
        return src

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(dest.parent, start, end)
    with written_whole(dest, prefix=f".{start}-{end}.") as tmp:
        _write_slice(reader, arch, n_layers, start, end, tmp)
    return dest


def trim_slices(out_dir: Path, keep: Collection[Path], quota: int) -> list[Path]:
    """Delete cached slices not in ``keep``, least recently used first, until the
    slices under ``out_dir`` take at most ``quota`` bytes; returns what was deleted.

    Slices in ``keep`` (those of the stages this node runs or is about to start) are
    never deleted, even when they alone exceed the quota: a running stage needs its file.
    """
    keep_set = {Path(p) for p in keep}
    slices: list[tuple[float, int, Path]] = []
    for path in Path(out_dir).glob("*/*.gguf"):
        with contextlib.suppress(OSError):
            st = path.stat()
            slices.append((st.st_mtime, st.st_size, path))
    # Folder slices of MLX models fetched from a peer (see folder_slicing).
    for path in Path(out_dir).glob("*/*.mlx"):
        with contextlib.suppress(OSError):
            size = sum(f.stat().st_size for f in path.iterdir())
            slices.append((path.stat().st_mtime, size, path))
    total = sum(size for _, size, _ in slices)
    removed: list[Path] = []
    for _, size, path in sorted(slices):
        if total <= quota:
            break
        if path in keep_set:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        total -= size
        removed.append(path)
    for folder in {p.parent for p in removed}:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
    return removed


#: A temporary slice older than this is a leftover of a cutter that died.
_STALE_TEMP_S = 24 * 3600


def _remove_stale_temps(folder: Path, start: int, end: int) -> None:
    """Delete temporary files of this range left by cutters that died mid-write.

    A slice of a large model is gigabytes; a crash must not leak it forever. Only
    files far older than any cut takes are removed, never a live cutter's.
    """
    now = time.time()
    for tmp in folder.glob(f".{start}-{end}.*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > _STALE_TEMP_S:
                tmp.unlink()


def _write_slice(
    reader: gguf.GGUFReader, arch: str, n_layers: int, start: int, end: int, out: Path
) -> None:
    writer = gguf.GGUFWriter(out, arch, endianess=reader.endianess)
    count_key = f"{arch}.block_count"
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    window_key = f"{arch}.attention.sliding_window"
    swa = swa_layers(meta, arch, n_layers)
    flags = swa[start:end] if swa is not None else None
    # A range of global layers only: llama.cpp's graph for these architectures needs a
    # windowed layer, so the slice windows them all by more than any context can hold
    # (the same attention as none).
    unwindowed = flags is not None and not any(flags)
    for field in reader.fields.values():
        name = field.name
        if flags is not None and name == pattern_key:
            continue  # written below as the range's own flags
        if unwindowed and name == window_key:
            continue
        # GGUF.* are the reader's virtual fields; the writer adds the architecture
        # itself; alignment is set through the writer so the data really follows it.
        if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE:
            continue
        if name == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(int(field.contents()))
            continue
        if name == count_key:
            writer.add_key_value(name, end - start, field.types[0])
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if (
            vtype == gguf.GGUFValueType.ARRAY
            and name.startswith(f"{arch}.")
            and isinstance(value, list)
            and len(value) == n_layers
        ):
            # Per-layer hyperparameters (head counts, sliding-window patterns of some
            # architectures) are arrays of block_count entries: keep the range's own.
            value = value[start:end]
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    for key, value in layer_count_defaults(meta, arch, n_layers).items():
        writer.add_key_value(key, value, gguf.GGUFValueType.FLOAT32)
    if flags is not None:
        # Layer il of the slice is layer start + il of the model: a pattern over the
        # slice's own indices would window the wrong layers once start is not a multiple.
        if unwindowed:
            flags = [True] * len(flags)
            writer.add_key_value(window_key, UNBOUNDED_WINDOW, gguf.GGUFValueType.UINT32)
        writer.add_key_value(
            pattern_key, flags, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL
        )

    kept: list[gguf.ReaderTensor] = []
    for t in reader.tensors:
        new_name = _renamed(t.name, start, end)
        if new_name is None:
            continue
        kept.append(t)
        # The reader's data for a quantized tensor is its raw bytes (uint8 rows);
        # passing raw_dtype makes the writer record the element shape and copy them.
        writer.add_tensor_info(
            new_name, t.data.shape, t.data.dtype, int(t.data.nbytes), t.tensor_type
        )

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


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

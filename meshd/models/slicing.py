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
import shutil
import time
from collections.abc import Collection
from pathlib import Path

from meshd.domain.facts import is_sha256

from .atomic import written_whole
from .gguf import read_metadata
from .slice_writer import layer_count, write_slice

__all__ = ["cache_folder", "slice_gguf", "slice_path", "trim_slices"]


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

    _, n_layers = layer_count(read_metadata(src), src)
    if end > n_layers:
        raise ValueError(f"layer range [{start}, {end}) is outside the model's {n_layers}")
    if start == 0 and end == n_layers:
        return src  # the whole range is the source itself

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(dest.parent, start, end)
    with written_whole(dest, prefix=f".{start}-{end}.") as tmp:
        write_slice(src, tmp, start, end)
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

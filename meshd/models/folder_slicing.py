"""Cut an MLX (safetensors) model folder into the folder of one range of layers, packed
as one archive that travels over the mesh like a GGUF slice.

The slice of layers ``[start, end)`` is a folder an MLX stage loads as a whole model
of ``end - start`` layers: ``config.json`` with that layer count (and per-layer lists
cut to the range, and the whole model's index of its first layer under
:data:`~meshd.models.folder.LAYER_OFFSET_KEY`: what a layer computes may depend on
that index, as Gemma 3's sliding-window pattern does, and the stage builds its layers
at their own indices), every other small file as it is (tokenizer, templates), and one
``model.safetensors`` holding the range's tensors renamed from layer 0 plus the global
ones (embedding, final norm, head), their bytes copied as they are (quantized weights,
scales and biases alike; nothing is loaded or converted). An image-text Gemma 3
folder is cut as the gemma3_text folder of its text model (its ``text_config`` and
``language_model.`` tensors, see :func:`~meshd.models.folder.text_model`): the vision
tower is left out.

The archive is a tar with sorted members, zero times and owners, so two holders of the
same folder cut byte-identical archives and a fetcher can pull from both at once.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from .atomic import written_whole
from .errors import ModelFormatError
from .folder import LAYER_OFFSET_KEY, read_safetensors_header, text_model, weight_files
from .mlx_layout import folder_name
from .slicing import cache_folder

__all__ = ["folder_slice_dir", "folder_slice_path", "slice_folder", "unpack_folder_slice"]

#: Config keys that give the layer count (the first present is rewritten).
_LAYER_KEYS = ("num_hidden_layers", "n_layers", "num_layers")
_WEIGHTS = "model.safetensors"


def folder_slice_path(out_dir: Path, sha256: str, start: int, end: int) -> Path:
    """Where the archive of layers ``[start, end)`` of the folder with this sha256 is."""
    return Path(out_dir) / cache_folder(sha256) / f"{start}-{end}.mlx.tar"


def folder_slice_dir(out_dir: Path, sha256: str, start: int, end: int) -> Path:
    """Where a fetched folder slice is unpacked (what its MLX stage loads)."""
    return Path(out_dir) / cache_folder(sha256) / f"{start}-{end}.mlx"


def slice_folder(src: Path, start: int, end: int, out_dir: Path, sha256: str) -> Path:
    """The archive of layers ``[start, end)`` of the model folder ``src``, cut if
    needed (written whole, then renamed into place). Raises ValueError for a bad
    range and ModelFormatError for a folder that is not a model."""
    src = Path(src)
    dest = folder_slice_path(out_dir, sha256, start, end)
    if dest.is_file():
        with contextlib.suppress(OSError):
            os.utime(dest)  # the cache evicts the least recently used first
        return dest
    config, prefix = text_model(json.loads((src / "config.json").read_text(encoding="utf-8")))
    key = next((k for k in _LAYER_KEYS if isinstance(config.get(k), int)), None)
    if key is None:
        raise ModelFormatError(f"{src}/config.json gives no layer count")
    n = int(config[key])
    if not 0 <= start < end <= n:
        raise ValueError(f"layer range [{start}, {end}) is outside the model's {n}")
    sliced = {
        k: (v[start:end] if isinstance(v, list) and len(v) == n and n > 1 else v)
        for k, v in config.items()
    }
    sliced[key] = end - start
    # A slice of a slice counts from the whole model's first layer still.
    offset = config.get(LAYER_OFFSET_KEY, 0)
    offset = (offset if isinstance(offset, int) else 0) + start
    if offset:
        sliced[LAYER_OFFSET_KEY] = offset
    with written_whole(dest, prefix=f".{start}-{end}.") as tmp:
        _write_archive(src, start, end, sliced, tmp, prefix)
    return dest


def _write_archive(
    src: Path, start: int, end: int, config: dict[str, Any], out: Path, prefix: str = ""
) -> None:
    """The tar of the slice: the cut config, the small files, the range's weights."""
    files = {
        p.name: p for p in sorted(src.iterdir())
        if p.is_file() and p.suffix != ".safetensors" and p.name != "config.json"
        and not p.name.endswith(".index.json")
    }  # fmt: skip
    members: dict[str, bytes | Path] = {
        "config.json": json.dumps(config, indent=2, sort_keys=True).encode(),
        **files,
    }
    with written_whole(out.with_suffix(".safetensors")) as weights:
        _write_weights(src, start, end, weights, prefix)
    try:
        members[_WEIGHTS] = out.with_suffix(".safetensors")
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(members):
                _add(tar, name, members[name])
    finally:
        out.with_suffix(".safetensors").unlink(missing_ok=True)


def _add(tar: tarfile.TarFile, name: str, content: bytes | Path) -> None:
    info = tarfile.TarInfo(name)
    info.mode, info.mtime, info.uid, info.gid = 0o644, 0, 0, 0
    if isinstance(content, bytes):
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
        return
    info.size = content.stat().st_size
    with open(content, "rb") as f:
        tar.addfile(info, f)


def _write_weights(src: Path, start: int, end: int, out: Path, prefix: str = "") -> None:
    """One safetensors file: the range's tensors (renamed from layer 0) and the global
    ones, sorted by name, bytes copied from the source files; with ``prefix``, only
    the tensors named under it, with the prefix taken off."""
    picked: dict[str, tuple[Path, int, dict[str, Any]]] = {}
    metadata: dict[str, str] = {}
    for file in weight_files(src):
        with open(file, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            raw = json.loads(f.read(hlen))
        if isinstance(raw.get("__metadata__"), dict) and not metadata:
            metadata = {str(k): str(v) for k, v in raw["__metadata__"].items()}
        for name, info in read_safetensors_header(file).items():
            if not name.startswith(prefix):
                continue
            new = folder_name(name[len(prefix) :], start, end)
            if new is not None:
                picked[new] = (file, 8 + hlen, info)
    if not picked:
        raise ModelFormatError(f"{src}: no tensors for layers [{start}, {end})")
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    order = sorted(picked)
    for name in order:
        _file, _base, info = picked[name]
        b, e = info["data_offsets"]
        header[name] = {
            "dtype": info["dtype"], "shape": info["shape"],
            "data_offsets": [offset, offset + (e - b)],
        }  # fmt: skip
        offset += e - b
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(out, "wb") as w:
        w.write(struct.pack("<Q", len(text)))
        w.write(text)
        for name in order:
            file, base, info = picked[name]
            b, e = info["data_offsets"]
            with open(file, "rb") as f:
                f.seek(base + b)
                left = e - b
                while left > 0:
                    block = f.read(min(left, 16 << 20))
                    if not block:
                        raise ModelFormatError(f"{file}: tensor {name} is cut short")
                    w.write(block)
                    left -= len(block)


def unpack_folder_slice(archive: Path, folder: Path) -> Path:
    """Unpack a fetched (verified) folder slice into ``folder`` (replaced whole)."""
    folder = Path(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        with tarfile.open(archive) as tar:
            # The archive was verified chunk by chunk, yet its names are a peer's words:
            # the data filter refuses absolute paths, links and "..".
            tar.extractall(tmp, filter="data")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder

"""Content ids: the sha256 of a model file, computed once per change of the file.

Hashing a 40 GB GGUF takes minutes, so the digest is cached in ``cache_dir/sha256.json``
by (absolute path, size, mtime_ns): a model is hashed once and again only when it
changes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .atomic import written_whole

__all__ = ["file_key", "file_sha256"]

#: Hash files in 8 MiB reads: large enough that Python overhead vanishes.
_HASH_CHUNK = 8 << 20


def file_key(path: Path) -> str:
    """``path|size|mtime_ns``: what a cache of facts about a file is keyed by (a file
    that changes gets a new key)."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _load_cache(file: Path) -> dict[str, str]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


def _store_cache(file: Path, entries: dict[str, str]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    # Two processes racing may drop each other's new entry; that costs one re-hash.
    with written_whole(file, prefix=".sha256.") as tmp:
        tmp.write_text(json.dumps(entries, indent=0, sort_keys=True))


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path, cache_dir: Path | None = None) -> str:
    """sha256 (hex) of a file, cached in ``cache_dir/sha256.json`` when given.

    The cache is keyed by (absolute path, size, mtime_ns): a model is hashed once
    and re-hashed only when the file changes. Without ``cache_dir`` it always hashes.
    """
    path = Path(path)
    if cache_dir is None:
        return _hash_file(path)
    cache_file = Path(cache_dir) / "sha256.json"
    key = file_key(path)
    entries = _load_cache(cache_file)
    hit = entries.get(key)
    if hit is not None:
        return hit
    digest = _hash_file(path)
    # Re-read just before writing so entries another process added meanwhile stay.
    entries = _load_cache(cache_file)
    entries[key] = digest
    _drop_stale(entries, path)
    _store_cache(cache_file, entries)
    return digest


def _drop_stale(entries: dict[str, str], path: Path) -> None:
    """Forget older (size, mtime) entries of the same path: they can never hit again."""
    prefix = f"{path.resolve()}|"
    current = file_key(path)
    for k in [k for k in entries if k.startswith(prefix) and k != current]:
        del entries[k]

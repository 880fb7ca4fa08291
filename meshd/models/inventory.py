"""What this node holds: the names of every model it can resolve, for its card.

A node advertises the models on its disk so that any node can place them on it. The
names listed are exactly those :func:`~meshd.models.resolve.resolve_model` resolves on
this machine (with the node's ``--models`` folders as ``extra_dirs``), each checked by
resolving it, so a plan naming one loads here:

* packaged aliases whose file is installed (``smollm2-135m``);
* the names the node was started with (``--model PATH``), as given;
* directly under each ``--models DIR``: every GGUF file by its stem (``foo`` for
  ``foo.gguf``; a split model by its first shard, ``foo-00001-of-00003``; projectors
  and later shards are never models of their own), every sub-folder that resolves (an
  MLX folder, config.json + safetensors, or a folder of GGUFs one of which is picked)
  by its name;
* every repo of the Hugging Face cache, and of ``models--org--name`` folders under a
  ``--models DIR``, with a complete snapshot: ``org/name``, or ``org/name:FILE.gguf``
  for each GGUF when it holds several.

Only names and headers' first bytes are read here (no hashing: facts are read later,
in the background). The scan goes no deeper than resolution does, skips what it cannot
read, and stops at :data:`MAX_HELD` names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from .gguf import is_gguf
from .resolve import (
    _SHARD,
    AmbiguousModelError,
    ModelNotFoundError,
    _snapshot,
    hf_hub_cache,
    local_models,
    resolve_model,
)

__all__ = ["MAX_HELD", "held_models"]

log = logging.getLogger("meshd.models")

#: Most names one node advertises: its card travels to every node, and peers refuse a
#: card over 128 KiB (``meshd.node.trust.VALUE_CAPS``).
MAX_HELD = 256

_REPO_PREFIX = "models--"


def held_models(
    model_dirs: Sequence[Path | str] = (),
    extra_paths: Iterable[str] = (),
    *,
    limit: int = MAX_HELD,
) -> list[str]:
    """Names of the models this node holds, sorted (see the module docs); each
    resolves with ``resolve_model(name, extra_dirs=model_dirs)`` to what was found."""
    dirs = [Path(d).expanduser() for d in model_dirs]
    names: set[str] = set()
    for name in _candidates(dirs, extra_paths):
        if name in names:
            continue
        if len(names) >= limit:
            log.warning(
                "this node holds more than %d models: only the first %d are advertised",
                limit, limit,
            )  # fmt: skip
            break
        names.add(name)
    return sorted(names)


def _candidates(dirs: list[Path], extra_paths: Iterable[str]) -> Iterator[str]:
    """Every name found, in a stable order, already checked to resolve."""
    yield from local_models()
    for name in extra_paths:
        if name and _resolves(name, dirs):
            yield name
    for d in dirs:
        for entry in _entries(d):
            yield from _dir_entry_names(entry, dirs)
    for cache in [hf_hub_cache(), *dirs]:
        for entry in _entries(cache):
            if entry.name.startswith(_REPO_PREFIX):
                yield from _repo_names(entry, dirs)


def _entries(folder: Path) -> list[Path]:
    """The folder's entries, sorted; none when it cannot be read."""
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _resolved(name: str, dirs: list[Path]) -> Path | None:
    """Where ``name`` resolves here, or None."""
    try:
        return Path(resolve_model(name, extra_dirs=dirs).path)
    except (ModelNotFoundError, AmbiguousModelError, ValueError, OSError):
        return None


def _resolves(name: str, dirs: list[Path], expected: Path | None = None) -> bool:
    """Whether ``name`` resolves here (to ``expected``, when given): a name that
    resolution finds elsewhere first (the working folder, an alias, another root) is
    not this model's name."""
    found = _resolved(name, dirs)
    return found is not None and (expected is None or found == expected.absolute())


def _is_model_gguf(path: Path) -> bool:
    """A GGUF llama.cpp would open as a model: not a projector, not a later shard."""
    name = path.name.lower()
    if not name.endswith(".gguf") or "mmproj" in name:
        return False
    shard = _SHARD.search(path.name)
    return shard is None or int(shard[1]) == 1


def _dir_entry_names(entry: Path, dirs: list[Path]) -> Iterator[str]:
    """The name of one entry of a ``--models`` folder, if it is a model."""
    try:
        if entry.name.startswith((".", _REPO_PREFIX)):
            return  # hidden, or a cached repo (listed by its repo id)
        if entry.is_file():
            if not (_is_model_gguf(entry) and is_gguf(entry)):
                return
            # The stem, unless something else answers to it (a folder of that name, an
            # alias): then the file name, which only this file answers to.
            for name in (entry.stem, entry.name):
                if _resolves(name, dirs, entry):
                    yield name
                    return
        elif entry.is_dir():
            # An MLX folder resolves to itself, a folder of GGUFs to one inside it.
            found = _resolved(entry.name, dirs)
            if found is not None and found.is_relative_to(entry.absolute()):
                yield entry.name
    except OSError as e:  # unreadable: not a model this node can serve
        log.debug("skipping %s: %s", entry, e)


def _repo_names(repo_dir: Path, dirs: list[Path]) -> Iterator[str]:
    """Names of one cached repo ``models--org--name``: ``org/name``, or one per GGUF
    (``org/name:FILE.gguf``) when it holds several."""
    parts = repo_dir.name[len(_REPO_PREFIX) :].split("--", 1)
    if len(parts) != 2 or not all(parts):
        return
    repo = "/".join(parts)
    try:
        if not repo_dir.is_dir():
            return
        snapshot = _snapshot(repo_dir)
        if snapshot is None:
            return  # an interrupted download: nothing to serve yet
        # The same two levels resolution looks at (quantisations in subfolders).
        found = [*snapshot.glob("*.gguf"), *snapshot.glob("*/*.gguf")]
        ggufs = sorted(p for p in found if _is_model_gguf(p) and p.is_file())
    except OSError as e:
        log.debug("skipping %s: %s", repo_dir, e)
        return
    if len(ggufs) == 1:
        candidates = [(repo, ggufs[0])]
    elif ggufs:
        candidates = [(f"{repo}:{p.name}", p) for p in ggufs]
    else:
        candidates = [(repo, snapshot)]  # an MLX folder, if it is one
    for name, path in candidates:
        if _resolves(name, dirs, path):
            yield name

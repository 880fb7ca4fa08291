"""``meshctl pull REPO_ID[:QUANT]``: download a model from the Hugging Face Hub into
this machine's Hugging Face cache, where the node on this machine finds it (within
``--models-rescan``) and every node lists it.

One machine downloads; the others need nothing: a node placed a stage of a GGUF it
lacks fetches that stage's layers from the holders over the mesh. ``huggingface_hub``
does the download (resumable, the cache layout every other tool shares); this module
only chooses the files: for a GGUF repo the one quantization asked for (``:QUANT``,
else the first of ``GGUF_QUANT_PREFERENCE`` present) with all its shards; for a
safetensors repo the folder an MLX stage loads (config, weights, tokenizer).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import PurePosixPath

from meshd.models.defaults import GGUF_QUANT_PREFERENCE

__all__ = ["PullError", "choose_files", "cmd_pull", "parse_spec", "pull"]

#: What an MLX (safetensors) model folder needs; nothing else in the repo is fetched.
FOLDER_PATTERNS = (
    "*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja",
)  # fmt: skip
_SHARD = re.compile(r"^(?P<stem>.*)-(?P<n>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)
_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")
#: Said when the hub cannot be reached: what to do instead on an offline LAN.
OFFLINE_HINT = (
    "copy the model file onto one machine, under a node's --models DIR: every node "
    "lists it, and a node that lacks it fetches its own layers from that one"
)


#: Seconds to reach the hub at all before giving up.
REACH_TIMEOUT_S = 8.0


class PullError(Exception):
    """A pull that cannot be done, said for the user (exit 1)."""


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``org/name[:QUANT]`` -> (repo id, quant or None); raises PullError."""
    repo, _, quant = spec.strip().partition(":")
    if not _REPO.match(repo):
        raise PullError(f"{spec!r} is not a Hugging Face repo id (org/name[:QUANT])")
    return repo, (quant.strip() or None)


def choose_files(repo: str, files: list[str], quant: str | None) -> list[str]:
    """The files (or patterns) of ``files`` to download for ``quant``; raises PullError."""
    ggufs = [
        f for f in files
        if f.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower()
    ]  # fmt: skip
    if not ggufs:
        if quant is not None:
            raise PullError(f"{repo} has no GGUF file, so no quantization {quant!r} to pick")
        if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
            raise PullError(f"{repo} holds neither a GGUF file nor a safetensors model")
        return list(FOLDER_PATTERNS)
    if quant is not None and quant.lower().endswith(".gguf"):
        picked = [f for f in ggufs if PurePosixPath(f).name.lower() == quant.lower()]
    elif quant is not None:
        picked = [f for f in ggufs if quant.lower() in PurePosixPath(f).name.lower()]
    else:
        picked = []
        for q in GGUF_QUANT_PREFERENCE:
            picked = [f for f in ggufs if q.lower() in PurePosixPath(f).name.lower()]
            if picked:
                break
    first = [f for f in picked if not _SHARD.match(PurePosixPath(f).name) or _shard_no(f) == 1]
    if len(first) != 1:
        names = ", ".join(PurePosixPath(f).name for f in ggufs)
        what = f"quantization {quant!r}" if quant else "a preferred quantization"
        many = "several files match" if len(first) > 1 else f"no file matches {what}"
        raise PullError(f"{repo}: {many}; name one with {repo}:QUANT (files: {names})")
    m = _SHARD.match(PurePosixPath(first[0]).name)
    if m is None:
        return first
    stem = m["stem"].lower()
    return sorted(
        f for f in ggufs
        if (s := _SHARD.match(PurePosixPath(f).name)) and s["stem"].lower() == stem
    )  # fmt: skip


def _shard_no(f: str) -> int:
    m = _SHARD.match(PurePosixPath(f).name)
    return int(m["n"]) if m else 0


def pull(spec: str) -> str:
    """Download ``spec`` into the Hugging Face cache; the local path. Raises PullError."""
    from huggingface_hub import constants, list_repo_files, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    repo, quant = parse_spec(spec)
    if constants.HF_HUB_OFFLINE:
        raise PullError(f"HF_HUB_OFFLINE is set: not downloading {repo}; {OFFLINE_HINT}")
    _reachable(constants.ENDPOINT, repo)
    try:
        files = list_repo_files(repo)
        chosen = choose_files(repo, files, quant)
        return snapshot_download(repo, allow_patterns=chosen)
    except PullError:
        raise
    except GatedRepoError:
        raise PullError(
            f"{repo} is gated: accept its terms on huggingface.co and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise PullError(f"{repo}: no such repository on the Hugging Face Hub") from None
    except OfflineModeIsEnabled:
        raise PullError(f"HF_HUB_OFFLINE is set: not downloading {repo}; {OFFLINE_HINT}") from None
    except Exception as e:  # the hub's client raises its HTTP stack's own types
        raise PullError(
            f"downloading {repo} failed ({type(e).__name__}: {str(e)[:200]}); {OFFLINE_HINT}"
        ) from None


def _reachable(endpoint: str, repo: str) -> None:
    """Fail in seconds when the hub cannot be reached at all (its client retries a
    refused connection for half a minute)."""
    import httpx

    try:
        httpx.head(endpoint, timeout=REACH_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise PullError(
            f"cannot reach the Hugging Face Hub at {endpoint} to download {repo} "
            f"({type(e).__name__}: {e}); {OFFLINE_HINT}"
        ) from None


def cmd_pull(args: argparse.Namespace) -> int:
    """Download a model from the Hugging Face Hub into this machine's cache."""
    try:
        path = pull(args.model)
    except PullError as e:
        print(f"meshctl pull: {e}", file=sys.stderr)
        return 1
    repo, quant = parse_spec(args.model)
    name = f"{repo}:{quant}" if quant else repo
    print(f"{name} is in {path}\nserve it: meshctl place {name}")
    return 0

"""Which model files this node will load: only those under its own roots.

A plan names its model by a string any member wrote; the node resolves it on its own
disk. Were any path taken, a member could make a node open any file it can read (and
feed a planted one to llama.cpp's parser), and the failure text would tell which files
exist. So a node loads only:

* a packaged model, by its alias (``smollm2-135m``) or its path;
* a file or folder under the local Hugging Face cache;
* a file or folder under one of its ``--models DIR``;
* a path given on its own command line (``--model PATH``).

Anything else is "model not available here", and nothing about the disk is said: to a
peer's plan as to a request through the API (a path named there does not become a
root; its 404 is the same whether or not the file exists).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from meshd.models import ModelNotFoundError, ResolvedModel, canonical_name, resolve_model
from meshd.models.resolve import ALIASES, hf_hub_cache

__all__ = ["ModelRoots"]

log = logging.getLogger("meshd.node")


class ModelRoots:
    """The model roots of one node."""

    def __init__(self, dirs: Iterable[Path | str] = (), allowed: Iterable[str] = ()) -> None:
        self.dirs = [Path(d).expanduser() for d in dirs]
        self._allowed: set[Path] = set()
        # A packaged model is a root by its path as well as by its alias.
        for name in [*ALIASES, *allowed]:
            self.allow(name)

    def allow(self, name: str) -> None:
        """Take the model ``name`` resolves to here as a root of its own (it came from
        this node's command line)."""
        try:
            r = resolve_model(name, extra_dirs=self.dirs)
        except (LookupError, ValueError):
            return
        self._allowed.add(Path(r.path).resolve())

    def resolve(self, name: str) -> ResolvedModel:
        """``name`` on this node, if it is under a root; else ModelNotFoundError (which
        says nothing of what is on the disk)."""
        try:
            r = resolve_model(name, extra_dirs=self.dirs)
        except (LookupError, ValueError) as e:
            log.info("model %r asked of this node is not here: %s", name, e)
            raise ModelNotFoundError(name, ["this node's model roots"]) from None
        if canonical_name(name) in ALIASES or self._under_a_root(Path(r.path)):
            return r
        log.warning("model %r is outside this node's model roots (%s): not loaded", name, r.path)
        raise ModelNotFoundError(name, ["this node's model roots"])

    def _under_a_root(self, path: Path) -> bool:
        p = path.resolve()
        if p in self._allowed:
            return True
        # A link the owner put in a root counts as in it (the owner chose what it points
        # to; no peer can make a link on this disk); ".." cannot climb out of a root.
        plain = Path(os.path.abspath(path))
        roots = [*self.dirs, hf_hub_cache()]
        return any(
            q.is_relative_to(r)
            for r in {*roots, *(root.resolve() for root in roots)}
            for q in (p, plain)
        )

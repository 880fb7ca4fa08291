"""Files that hold secrets (keys, tokens): written 0600, never through a symlink.

Stdlib only, apart from :mod:`meshd.transport.security` (which re-exports both and
imports zmq): ``meshctl`` reads its key files and the owner token with these at start,
and must start in 0.3 s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from pathlib import Path

__all__ = ["read_private", "write_private"]

# The logger these warnings always had (they were written in security.py).
log = logging.getLogger("meshd.transport.security")


def write_private(path: Path, data: bytes, *, replace: bool = False) -> None:
    """Write ``data`` to a new file only this user can read (0600).

    Created with ``O_EXCL|O_NOFOLLOW``: never through a symlink someone planted, never
    over a file that is there. ``replace`` writes a new file beside it first and renames
    it over the old one (atomic; a symlink at ``path`` is replaced, not followed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp") if replace else path
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(target, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if replace:
            os.replace(target, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(target)
        raise


def read_private(path: Path) -> bytes:
    """The bytes of a secret file (not through a symlink; warns when others can read it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("secret file %s is readable by other users; chmod 600 it", path)
        return f.read()

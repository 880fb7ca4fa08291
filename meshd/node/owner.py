"""The node owner's credential: ``owner.token`` in the data dir, readable by its owner only.

The API takes administration (invites, members, placing and removing instances) only
with an admin credential (``meshd.api.auth``). On the node's own machine that is this
token: made at the node's first start (0600, with
:func:`~meshd.transport.secret_files.write_private`), read by ``meshctl`` run by the same
user, which sends it with no flag. Another user of the machine cannot read the file, so
cannot administer the cluster, though it may still reach the loopback API.

A token file others can read (a copied data dir, a chmod) is no longer a secret: the
node replaces it with a fresh one at start, and says so.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from meshd.transport.secret_files import write_private

__all__ = ["OWNER_FILE", "ensure_owner_token", "read_owner_token"]

log = logging.getLogger("meshd.node")

OWNER_FILE = "owner.token"
#: Random bytes of a token (43 characters of URL-safe base64).
_TOKEN_BYTES = 32


def _read(path: Path) -> tuple[str, int]:
    """The token in ``path`` and the file's mode (never through a symlink)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        return f.read(4096).decode("ascii", "replace").strip(), mode


def ensure_owner_token(data_dir: Path) -> str:
    """The owner token of the node on ``data_dir``, made on first use (call it with the
    data dir locked, as ``meshd up`` does once the node started).

    A missing, empty, unreadable or symlinked file, or one others may read, is replaced
    by a fresh token (the old one, if any, stops working).
    """
    path = data_dir / OWNER_FILE
    why = ""
    try:
        token, mode = _read(path)
        if not stat.S_ISREG(mode):
            why = "it is not a regular file"
        elif mode & (stat.S_IRWXG | stat.S_IRWXO):
            why = f"its mode {stat.S_IMODE(mode):o} lets other users read it"
        elif len(token) < 32 or not token.isascii() or not token.isprintable():
            why = "it holds no token"
        else:
            return token
    except FileNotFoundError:
        pass
    except OSError as e:  # a symlink (ELOOP), a directory, no permission
        why = f"it cannot be read ({e.strerror})"
    if why:
        log.warning("replacing the owner token %s: %s", path, why)
    token = secrets.token_urlsafe(_TOKEN_BYTES)
    write_private(path, (token + "\n").encode(), replace=why != "")
    return token


def read_owner_token(data_dir: Path) -> str | None:
    """The owner token in ``data_dir`` as ``meshctl`` reads it: None when there is none
    or this user may not read it (another user's node: the API then says how to
    administer it)."""
    try:
        token, mode = _read(data_dir / OWNER_FILE)
    except OSError:
        return None
    return token if token and stat.S_ISREG(mode) else None

"""A node's stable identity, kept in its data directory.

The identity is an Ed25519 key (``node.key``, 0600; see ``meshd.transport.identity``);
the node id is derived from its public half. It survives restarts so a restarted node
rejoins as itself. It must never be shared: the identity file records a fingerprint of
the machine and of the data directory's path; a copy of the directory on another
machine (or moved elsewhere) gets a fresh key and id instead of silently impersonating
the original. Two processes on one data directory are stopped by an exclusive lock.

The directory is this user's alone (0700, tightened at start when an older meshd left
it 0755), and so are the files in it that say anything of the cluster (0600).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from meshd.transport.identity import NodeKey
from meshd.transport.security import read_private, write_private

from .cluster_store import STATE_FILE

log = logging.getLogger("meshd.node")

ID_FILE = "identity.json"
KEY_FILE = "node.key"
LOCK_FILE = "meshd.lock"


class DataDirLockedError(RuntimeError):
    """Another meshd process holds this data directory."""


_IOREG_UUID = re.compile(r'"IOPlatformUUID"\s*=\s*"([^"]+)"')


def _macos_platform_uuid() -> str | None:
    """The Mac's hardware UUID (``IOPlatformUUID``), or None where ``ioreg`` is missing
    or says nothing usable. The hostname is a poor id on macOS: it follows the network
    (``MacBook-Pro.local`` on one LAN, ``MacBook-Pro-2.local`` on the next)."""
    ioreg = shutil.which("ioreg")
    if ioreg is None:
        return None
    try:
        out = subprocess.run(
            [ioreg, "-rd1", "-c", "IOPlatformExpertDevice"],
            capture_output=True, text=True, timeout=5, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    m = _IOREG_UUID.search(out)
    return m[1] if m else None


def machine_id() -> str:
    """A best-effort stable id of this machine (not secret, never sent anywhere)."""
    for p in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            v = Path(p).read_text().strip()
            if v:
                return v
        except OSError:
            continue
    if sys.platform == "darwin" and (mac := _macos_platform_uuid()):
        return mac
    return f"{socket.gethostname()}-{uuid.getnode():x}-{platform.system()}"


def fingerprint(data_dir: Path) -> str:
    """Hash of this machine's id and the data directory's absolute path."""
    raw = f"{machine_id()}|{data_dir.resolve()}".encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


@dataclass
class Identity:
    """The node's key and the open lock that keeps the data directory ours."""

    key: NodeKey
    data_dir: Path
    _lock: IO[str] | None = None
    #: True when the key was created now (first start, or a copied data directory).
    fresh: bool = False

    @property
    def node_id(self) -> str:
        """The node id (derived from the key)."""
        return self.key.node_id

    def release(self) -> None:
        """Release the data directory lock."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _lock(data_dir: Path) -> IO[str]:
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    f = os.fdopen(fd, "a+")
    try:
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # Windows: no flock; the id fingerprint still guards copies
        pass
    except OSError:
        f.close()
        raise DataDirLockedError(
            f"another meshd process is using {data_dir} (lock {data_dir / LOCK_FILE})"
        ) from None
    return f


def load_identity(data_dir: Path) -> Identity:
    """Lock ``data_dir`` and return its identity, making a new key when needed.

    The directory is made 0700, and tightened to it when this user owns it and others
    may read it (an older meshd made it 0755, its ``cluster.json`` 0644)."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    tighten(data_dir)
    lock = _lock(data_dir)
    try:
        return _load(data_dir, lock)
    except BaseException:
        lock.close()
        raise


def tighten(data_dir: Path) -> None:
    """Make ``data_dir`` 0700 and its state files 0600 where this user owns them and
    others may read them (never through a symlink; someone else's is left alone)."""
    getuid = getattr(os, "getuid", None)
    if getuid is None or data_dir.resolve() == Path.home().resolve():
        return  # Windows: modes mean little there; a home dir: not meshd's to change
    for path, mode in (
        (data_dir, 0o700),
        (data_dir / ID_FILE, 0o600),
        (data_dir / STATE_FILE, 0o600),
    ):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode) or st.st_uid != getuid() or not st.st_mode & 0o077:
            continue
        os.chmod(path, mode)
        log.info("%s was readable by other users: now %o", path, mode)


def _load(data_dir: Path, lock: IO[str]) -> Identity:
    fp = fingerprint(data_dir)
    path = data_dir / ID_FILE
    try:
        saved = json.loads(path.read_text())
        node_id, saved_fp = str(saved["node_id"]), str(saved["fingerprint"])
        key = NodeKey(read_private(data_dir / KEY_FILE))
    except (OSError, ValueError, KeyError, TypeError):
        node_id, saved_fp, key = "", "", None
    if key is not None and key.node_id == node_id and saved_fp == fp:
        return Identity(key, data_dir, lock)
    if node_id:
        log.warning(
            "data dir %s was copied or moved (fingerprint changed): new node key and id, "
            "so this node cannot be mistaken for %s",
            data_dir,
            node_id,
        )
    key = NodeKey.generate()
    write_private(data_dir / KEY_FILE, key.seed, replace=(data_dir / KEY_FILE).exists())
    write_private(
        path, json.dumps({"node_id": key.node_id, "fingerprint": fp}).encode(), replace=True
    )
    return Identity(key, data_dir, lock, fresh=True)

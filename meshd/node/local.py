"""The node on this machine as a local client finds it: its data dir (where the owner
token is), its cache dir, and the environment variables of the API's keys.

Stdlib only: ``meshctl`` reads these at start, and must start in 0.3 s (the rest of
``meshd.node`` brings zmq, nacl, msgspec and the models' numpy).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

__all__ = ["ADMIN_KEY_ENV", "API_KEY_ENV", "cache_dir_for", "default_data_dir", "move_old_cache"]

#: Environment variable with the API key (inference and reading; never argv, where
#: ``ps`` shows it: else ``--api-key-file``).
API_KEY_ENV = "MESHD_API_KEY"
#: Environment variable with the admin key (remote administration; else
#: ``--admin-key-file``). The node's owner needs none: ``owner.py``.
ADMIN_KEY_ENV = "MESHD_ADMIN_KEY"


def default_data_dir() -> Path:
    """``$MESHD_DATA_DIR``, else the platform's per-user data folder + ``/meshd``."""
    env = os.environ.get("MESHD_DATA_DIR")
    if env:
        return Path(env).expanduser()
    return _platform_data_dir()


def _platform_data_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "meshd"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "meshd"


def _platform_cache_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "meshd"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshd"


def cache_dir_for(data_dir: Path) -> Path:
    """Where a node on ``data_dir`` caches slices, hashes, facts and its engine probe.

    The platform's cache folder (``$XDG_CACHE_HOME/meshd``, ``~/.cache/meshd``,
    ``~/Library/Caches/meshd``) for the platform's own data dir: a cache is what backups
    skip and the system may clear, and gigabytes of slices do not belong beside the
    node's keys. A data dir named by ``--data-dir`` or ``$MESHD_DATA_DIR`` keeps its
    cache inside it (``<data dir>/cache``), so two nodes on one machine keep theirs
    apart, as before."""
    if data_dir.expanduser().absolute() == _platform_data_dir().absolute():
        return _platform_cache_dir()
    return data_dir / "cache"


def move_old_cache(data_dir: Path, cache_dir: Path) -> bool:
    """Move the cache an older meshd kept in ``<data dir>/cache`` to ``cache_dir`` when
    that is elsewhere and holds nothing yet (no slice is cut or fetched again); True
    when it moved."""
    old = data_dir / "cache"
    if old == cache_dir or not old.is_dir() or cache_dir.exists():
        return False
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(old), str(cache_dir))
    logging.getLogger("meshd.node").info("moved the cache of %s to %s", data_dir, cache_dir)
    return True

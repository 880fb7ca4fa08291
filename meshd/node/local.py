"""The node on this machine as a local client finds it: its data dir (where the owner
token is) and the environment variables of the API's keys.

Stdlib only: ``meshctl`` reads these at start, and must start in 0.3 s (the rest of
``meshd.node`` brings zmq, nacl, msgspec and the models' numpy).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["ADMIN_KEY_ENV", "API_KEY_ENV", "default_data_dir"]

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
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "meshd"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "meshd"

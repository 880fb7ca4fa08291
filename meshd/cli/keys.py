"""The API's keys on both command lines: read from a file or the environment, never argv.

``ps`` shows every user of a machine the command lines of every process, so a key given
as ``--api-key KEY`` is a key given to all of them. ``meshd up`` and ``meshctl`` take a
key from a file (``--api-key-file``, ``--admin-key-file``) or the environment
(``$MESHD_API_KEY``, ``$MESHD_ADMIN_KEY``; ``meshd`` also from its config file), and
refuse ``--api-key KEY`` with a line that says so.

* The **API key** opens inference and reading only (``meshd.api.auth``).
* The **admin key** opens administration from anywhere: remote administration.
* The **owner token** opens administration from the node's own machine: ``meshd up``
  makes it in the data dir (``meshd.node.owner``) and ``meshctl`` sends it when its user
  can read it and the node it asks is on loopback (so it never leaves the machine).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

# Each of these is stdlib only: meshctl imports this module, and must start in 0.3 s.
from meshd.node.local import ADMIN_KEY_ENV, API_KEY_ENV, default_data_dir
from meshd.node.owner import read_owner_token
from meshd.transport.secret_files import read_private

if TYPE_CHECKING:
    from .settings import Resolved

__all__ = ["add_key_flags", "add_meshctl_key_flags", "meshctl_keys", "node_keys", "refuse_argv"]

#: (setting, environment variable, what it opens) of each key.
_KEYS = (
    ("api_key", API_KEY_ENV, "inference and reading (never administration)"),
    ("admin_key", ADMIN_KEY_ENV, "remote administration (sent as x-meshd-admin)"),
)


def _refused(option: str, env: str) -> str:
    return (
        f"{option} is not taken on the command line, where ps shows it to every user of "
        f"this machine: put the key in a file only you can read and pass {option}-file "
        f"PATH, or set ${env}"
    )


def _path(text: str) -> Path:
    return Path(text).expanduser()


def add_key_flags(up: argparse.ArgumentParser) -> None:
    """The key settings of ``meshd up``: ``--api-key-file``/``--admin-key-file``, and
    ``--api-key``/``--admin-key``, which exist for ``$MESHD_API_KEY``/``$MESHD_ADMIN_KEY``
    and the config file only (:func:`refuse_argv` refuses them as flags)."""
    from .settings import mark_secret  # imported here, as in refuse_argv

    for key, env, opens in _KEYS:
        option = "--" + key.replace("_", "-")
        up.add_argument(
            option + "-file",
            type=_path,
            metavar="PATH",
            help=f"file holding the key that opens {opens}; "
            + ("the API then listens on every interface" if key == "api_key" else "unset: none"),
        )
        mark_secret(
            up.add_argument(
                option, metavar="KEY", help=f"only as ${env} or in the config file, never argv"
            )
        )


def refuse_argv(resolved: Resolved) -> None:
    """Raise :class:`ConfigError` when a key came as a flag (``meshd up --api-key KEY``)."""
    # imported here: only ``meshd up`` reads settings, and meshctl (which imports this
    # module) must start in 0.3 s (settings brings tomllib, difflib, dataclasses)
    from .settings import ConfigError

    for key, env, _ in _KEYS:
        if resolved.sources.get(key) == "flag":
            raise ConfigError(_refused("--" + key.replace("_", "-"), env))


def _read_key(path: Path, option: str) -> str:
    try:
        key = read_private(path).decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{option} {path}: cannot read the key: {e}") from None
    if not key:
        raise ValueError(f"{option} {path}: the file is empty")
    return key


def node_keys(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The API key and the admin key of ``meshd up`` (ValueError: unreadable, given
    twice, or one key for both: whoever holds the API key would be an admin)."""
    found: list[str | None] = []
    for key, env, _ in _KEYS:
        option = "--" + key.replace("_", "-") + "-file"
        value, path = getattr(args, key), getattr(args, key + "_file")
        if value and path:
            raise ValueError(f"the {key.replace('_', ' ')} is given twice (${env} or the "
                             f"config file, and {option}): give one")  # fmt: skip
        found.append(_read_key(path, option) if path else value or None)
    api_key, admin_key = found
    if api_key and api_key == admin_key:
        raise ValueError("the admin key must not be the API key: every inference client "
                         "would administer the cluster")  # fmt: skip
    return api_key, admin_key


class _Refuse(argparse.Action):
    """``meshctl --api-key KEY``: a usage error that says where the key goes instead."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        env = API_KEY_ENV if self.dest == "api_key" else ADMIN_KEY_ENV
        raise argparse.ArgumentError(self, _refused(self.option_strings[0], env))


def add_meshctl_key_flags(common: argparse.ArgumentParser) -> None:
    """``meshctl``'s credentials: key files, the data dir of the owner token."""
    for key, env, opens in _KEYS:
        option = "--" + key.replace("_", "-")
        common.add_argument(option + "-file", type=_path, default=argparse.SUPPRESS,
                            metavar="PATH", help=f"file holding the key that opens {opens} "
                            f"(default: the key in ${env})")  # fmt: skip
        common.add_argument(option, action=_Refuse, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)  # fmt: skip
    common.add_argument(
        "--data-dir", type=_path, default=argparse.SUPPRESS, metavar="DIR",
        help="data dir of the node on this machine, whose owner token administers it "
        "(default: $MESHD_DATA_DIR, else the user data dir)",
    )  # fmt: skip


def _is_loopback(base_url: str) -> bool:
    host = (urlsplit(base_url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def meshctl_keys(
    args: argparse.Namespace, base_url: str, env: Mapping[str, str] | None = None
) -> tuple[str | None, str | None]:
    """The API key and the admin credential ``meshctl`` sends to ``base_url``: each key
    from its file, else the environment; the admin credential, failing the admin key,
    is the owner token when this user can read it and the node is on loopback (a remote
    node has no use for it, and must not see it). ValueError: an unreadable key file."""
    environ = os.environ if env is None else env
    found: list[str | None] = []
    for key, var, _ in _KEYS:
        path = getattr(args, key + "_file", None)
        option = "--" + key.replace("_", "-") + "-file"
        found.append(_read_key(path, option) if path else environ.get(var, "").strip() or None)
    api_key, admin = found
    if admin is None and _is_loopback(base_url):
        data_dir = getattr(args, "data_dir", None)
        if data_dir is None:
            named = environ.get("MESHD_DATA_DIR")
            data_dir = Path(named).expanduser() if named else default_data_dir()
        admin = read_owner_token(data_dir)
    return api_key, admin

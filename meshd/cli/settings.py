"""Where each setting of ``meshd up`` comes from: flag > environment > config file > default.

The table of settings is the ``up`` parser itself: each long option is a setting, keyed
by its name without dashes (``--api-port`` -> ``api_port``), read from ``MESHD_<KEY>``
(``MESHD_API_PORT``) and from a TOML file, and converted and checked by the option's
own ``type=`` and ``choices``. A new flag is thereby settable from the file and the
environment with no second list to keep in sync.

A bad file, key or value raises :class:`ConfigError`: one line that names the file or
variable and the key, which ``meshd`` prints before exiting 2, as argparse does for a
bad flag.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "ConfigError",
    "Resolved",
    "Setting",
    "Settings",
    "default_config_path",
    "given_dests",
    "mark_secret",
]

#: The config file to read when ``--config`` is not given (a missing one is an error).
CONFIG_ENV = "MESHD_CONFIG"
#: ``MESHD_<KEY>`` sets a setting; the key in upper case (``MESHD_API_PORT``).
ENV_PREFIX = "MESHD_"
CONFIG_FILE = "meshd.toml"
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")
#: The attribute :func:`mark_secret` sets on an argparse action.
_SECRET_ATTR = "meshd_secret"
#: What a secret setting shows instead of its value.
MASK = "****"

Kind = Literal["value", "list", "switch"]


class ConfigError(Exception):
    """A bad config file, key or value: one line for the user (exit 2)."""


def mark_secret(action: argparse.Action) -> argparse.Action:
    """Mark the setting of ``action`` secret: ``meshd config show`` masks its value.

    The mark is on the flag's own declaration, so a renamed flag keeps it."""
    setattr(action, _SECRET_ATTR, True)
    return action


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """Where the config file is when neither ``--config`` nor ``$MESHD_CONFIG`` says:
    the platform's per-user config folder + ``meshd/meshd.toml``."""
    environ = os.environ if env is None else env
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "meshd" / CONFIG_FILE
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "meshd" / CONFIG_FILE


@dataclass(frozen=True)
class Setting:
    """One setting: a long option of the parser, and how to read it from text or TOML."""

    key: str
    option: str
    dest: str
    kind: Kind
    default: Any
    #: For a switch (``store_true``): the value it has when on.
    const: Any = None
    convert: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    secret: bool = False

    @property
    def env(self) -> str:
        """The environment variable that sets it."""
        return ENV_PREFIX + self.key.upper()

    def from_env(self, text: str) -> Any:
        """The value of ``$MESHD_<KEY>``: a list is comma-separated, a switch is one of
        1/true/yes/0/false/no."""
        where = self.env
        if self.kind == "switch":
            word = text.strip().lower()
            if word in _TRUE:
                return self.const
            if word in _FALSE:
                return self.default
            raise ConfigError(f"{where}: {text!r} is not one of {'/'.join(_TRUE + _FALSE)}")
        if self.kind == "list":
            return [self._one(t.strip(), where) for t in text.split(",") if t.strip()]
        return self._one(text, where)

    def from_toml(self, value: Any, where: str) -> Any:
        """The value of this key in a TOML file (``where`` names the file in errors)."""
        if self.kind == "switch":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: {self.key}: expected true or false, got {value!r}")
            return self.const if value else self.default
        if self.kind == "list":
            # A single value is a list of one: `peer = "10.0.0.2"` reads as it says.
            items = value if isinstance(value, list) else [value]
            return [self._one(_scalar(self.key, v, where), where) for v in items]
        return self._one(_scalar(self.key, value, where), where)

    def _one(self, text: str, where: str) -> Any:
        # The flag's own converter, so a value means the same wherever it is written.
        try:
            value = self.convert(text) if self.convert is not None else text
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{where}: {self.key}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {self.key}: invalid value {text!r} ({e})") from None
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(map(str, self.choices))
            raise ConfigError(f"{where}: {self.key}: {value!r} is not one of {allowed}")
        return value


def _scalar(key: str, value: Any, where: str) -> str:
    """A TOML string or number as the text a flag would carry (TOML has no sizes)."""
    # bool is an int in Python; `api_port = true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{where}: {key}: expected a string or a number, got {value!r}")
    return str(value)


def _setting(action: argparse.Action) -> Setting | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or isinstance(action, argparse._HelpAction | argparse._VersionAction):
        return None
    option = longs[0]
    key = option[2:].replace("-", "_")
    secret = bool(getattr(action, _SECRET_ATTR, False))
    common: dict[str, Any] = {"key": key, "option": option, "dest": action.dest, "secret": secret}
    if action.nargs == 0:  # store_true, store_false, store_const
        return Setting(kind="switch", default=action.default, const=action.const, **common)
    # A string default is a flag's text that argparse converts; so does this.
    default = action.default
    if isinstance(default, str) and action.type is not None:
        default = action.type(default)  # type: ignore[operator]  # a callable, never a str here
    many = isinstance(action, argparse._AppendAction) or action.nargs not in (None, "?")
    return Setting(
        kind="list" if many else "value",
        default=default,
        convert=action.type,  # type: ignore[arg-type]  # our flags' types are callables
        choices=list(action.choices) if action.choices is not None else None,
        **common,
    )


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subparser under it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def given_dests(
    make_parser: Callable[[], argparse.ArgumentParser], argv: Sequence[str]
) -> set[str]:
    """The dests the command line ``argv`` set, parsed by a fresh ``make_parser()``.

    A parsed namespace cannot tell a default from a flag given the same value, and a
    flag must win over the environment and the file even then. So ``argv`` is parsed a
    second time by a parser with no defaults: its namespace holds what was given only.
    Call it after the real parse succeeded (this one prints no help and no errors).
    """
    parser = make_parser()
    for p in _parsers(parser):
        for action in p._actions:
            if action.option_strings:
                action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(list(argv))))


@dataclass
class Resolved:
    """The effective settings: values by dest, and where each came from."""

    values: dict[str, Any]
    #: By key: ``flag``, ``env MESHD_X``, ``file PATH`` or ``default``.
    sources: dict[str, str]
    #: The config file read (None: none was there).
    file: Path | None
    #: The config file looked for.
    looked_at: Path
    settings: list[Setting] = field(default_factory=list)

    def apply(self, args: argparse.Namespace) -> argparse.Namespace:
        """``args`` with every setting set to its effective value."""
        for dest, value in self.values.items():
            setattr(args, dest, value)
        return args

    def shown(self, s: Setting) -> Any:
        """The value of ``s`` fit to print: plain JSON types, a secret masked."""
        value = self.values[s.dest]
        if s.secret and value:
            return MASK
        return _plain(value)

    def as_json(self) -> dict[str, Any]:
        """What ``meshd config show --json`` prints."""
        return {
            "config_file": str(self.file) if self.file else None,
            "settings": {
                s.key: {"value": self.shown(s), "source": self.sources[s.key], "env": s.env}
                for s in self.settings
            },
        }

    def as_text(self) -> str:
        """What ``meshd config show`` prints: one aligned line a setting."""
        head = (
            f"config file: {self.file}"
            if self.file
            else f"config file: none ({self.looked_at} does not exist)"
        )
        rows = [("setting", "value", "source")]
        rows += [(s.key, _text(self.shown(s)), self.sources[s.key]) for s in self.settings]
        w0 = max(len(r[0]) for r in rows)
        w1 = min(40, max(len(r[1]) for r in rows))
        lines = [f"{k:<{w0}}  {v:<{w1}}  {src}".rstrip() for k, v, src in rows]
        return "\n".join([head, "", *lines])


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _text(value: Any) -> str:
    if value is None or value == []:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


class Settings:
    """The settings of one parser: each of its long options but ``--help``."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        found = (_setting(a) for a in parser._actions)
        self.settings = [s for s in found if s is not None]
        self.by_key = {s.key: s for s in self.settings}

    def resolve(
        self,
        args: argparse.Namespace,
        given: set[str],
        *,
        config: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Resolved:
        """Each setting's value and source: ``args`` (a parsed namespace) where
        ``given`` (see :func:`given_dests`) holds its dest, else ``$MESHD_<KEY>``, else
        the config file, else the default.

        ``config``: the ``--config`` path (a missing file is an error); None reads
        ``$MESHD_CONFIG`` (likewise), else :func:`default_config_path` if it exists.
        Raises :class:`ConfigError`.
        """
        environ = os.environ if env is None else env
        path, required = _config_path(config, environ)
        table = self._read(path, required)
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for s in self.settings:
            # An empty variable counts as unset (`MESHD_API_KEY= meshd up` has no key).
            text = environ.get(s.env, "")
            if s.dest in given:
                values[s.dest], sources[s.key] = getattr(args, s.dest), "flag"
            elif text:
                values[s.dest], sources[s.key] = s.from_env(text), f"env {s.env}"
            elif table is not None and s.key in table:
                values[s.dest] = s.from_toml(table[s.key], str(path))
                sources[s.key] = f"file {path}"
            else:
                values[s.dest], sources[s.key] = getattr(args, s.dest, s.default), "default"
        return Resolved(values, sources, path if table is not None else None, path, self.settings)

    def _read(self, path: Path, required: bool) -> dict[str, Any] | None:
        """The file's settings by key (None: no file there and none was asked for)."""
        try:
            with path.open("rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            if required:
                raise ConfigError(f"{path}: no such config file") from None
            return None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        table: dict[str, Any] = {}
        unknown: list[str] = []
        for name, value in raw.items():
            key = name.replace("-", "_")
            if key not in self.by_key:
                unknown.append(self._unknown(name))
            elif key in table:
                raise ConfigError(f"{path}: {key} is set twice")
            else:
                table[key] = value
        if unknown:
            plural = "s" if len(unknown) > 1 else ""
            raise ConfigError(f"{path}: unknown setting{plural}: {', '.join(unknown)}")
        return table

    def _unknown(self, name: str) -> str:
        close = difflib.get_close_matches(name.replace("-", "_"), self.by_key, n=1)
        return f"{name} (did you mean {close[0]}?)" if close else name


def _config_path(config: str | Path | None, env: Mapping[str, str]) -> tuple[Path, bool]:
    """The config file to read, and whether it must exist: one that was named must."""
    if config is not None:
        return Path(config).expanduser().absolute(), True
    named = env.get(CONFIG_ENV, "")
    if named:
        return Path(named).expanduser().absolute(), True
    return default_config_path(env), False

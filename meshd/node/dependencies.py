"""The packages meshd reaches into, checked against the range it was tested with.

meshd uses private parts of a few packages: llama-cpp-python's ctypes symbols and an
internal graph node name of llama.cpp, mlx-lm's model classes and cache internals,
MLX's device calls, msgspec's error wording. A release outside the range the suite
passed with may break any of them deep in a request; a node says so at start (and
``meshctl doctor`` again) instead, naming the tested set to install.

The ranges are meshd's own requirements (``pyproject.toml``, read back from the
installed distribution's metadata): one place states them. :func:`outside` is pure.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from importlib import metadata

import msgspec
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

__all__ = [
    "WATCHED",
    "Untested",
    "installed_versions",
    "outside",
    "tested_ranges",
    "untested",
    "warn_untested",
]

#: Packages whose private parts meshd uses (by canonical name).
WATCHED = ("llama-cpp-python", "mlx", "mlx-lm", "msgspec")

#: The install line that brings the tested set back.
FIX = "pip install -c constraints.txt -e . (./install.sh does), or the versions named"


class Untested(msgspec.Struct, frozen=True, kw_only=True):
    """One installed package outside meshd's tested range."""

    name: str
    installed: str
    tested: str

    def line(self) -> str:
        """One line for a log or a doctor finding."""
        return f"{self.name} {self.installed} is installed; meshd was tested with {self.tested}"


def tested_ranges(dist: str = "meshd", watched: tuple[str, ...] = WATCHED) -> dict[str, str]:
    """Canonical name -> version specifier of each watched package, from ``dist``'s
    installed requirements (every platform's and extra's); empty when meshd runs from
    a source tree that was never installed."""
    try:
        reqs = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return {}
    out: dict[str, str] = {}
    for line in reqs:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = canonicalize_name(req.name)
        if name in watched and str(req.specifier):
            out.setdefault(name, str(req.specifier))
    return out


def installed_versions(names: tuple[str, ...] = WATCHED) -> dict[str, str | None]:
    """Canonical name -> the installed version, None where it is not installed."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def outside(ranges: Mapping[str, str], installed: Mapping[str, str | None]) -> list[Untested]:
    """The installed packages whose version is outside their tested range (an unreadable
    version counts as outside; a package not installed does not: its engine is absent)."""
    out = []
    for name, spec in sorted(ranges.items()):
        version = installed.get(name)
        if version is None:
            continue
        try:
            ok = SpecifierSet(spec).contains(Version(version), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            out.append(Untested(name=name, installed=version, tested=spec))
    return out


def untested() -> list[Untested]:
    """This interpreter's watched packages outside meshd's tested ranges."""
    return outside(tested_ranges(), installed_versions())


def warn_untested() -> None:
    """Log a warning for each watched package outside its tested range (at start)."""
    for u in untested():
        logging.getLogger("meshd").warning("%s: it may fail in a request; %s", u.line(), FIX)

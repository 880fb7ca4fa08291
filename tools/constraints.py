"""Print constraints.txt: the installed versions of meshd's dependency closure (with the
``test`` and ``mlx`` extras), as pins. Run it after a green suite, in the environment
that passed: ``python3 tools/constraints.py > constraints.txt``."""

from __future__ import annotations

import sys
from datetime import date
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEADER = """\
# The versions the whole suite passed with ({platform}, Python {python}; {day}):
# ./install.sh and .ci/run install with `-c constraints.txt`, so a fresh machine gets
# the set that was tested, not whatever is newest. pyproject.toml holds the ranges meshd
# accepts (bounded where it reaches into a package's private parts); refresh this file
# from a green run: python3 tools/constraints.py > constraints.txt"""


def closure(root: str = "meshd", extras: frozenset[str] = frozenset({"test", "mlx"})) -> dict:
    """Canonical name -> installed version of every package ``root`` needs here."""
    pins: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform
        key = (canonicalize_name(dist.metadata["Name"]), wanted)
        if key in seen:
            continue
        seen.add(key)
        pins[key[0]] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                todo.append((req.name, frozenset(req.extras)))
    pins.pop(canonicalize_name(root), None)
    return pins


def main() -> int:
    """Print the pins."""
    import platform

    print(HEADER.format(platform=f"{platform.system()} {platform.machine()}",
                        python=".".join(map(str, sys.version_info[:2])),
                        day=date.today().isoformat()))  # fmt: skip
    for name, version in sorted(closure().items()):
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

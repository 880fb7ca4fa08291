"""Files written whole or not at all: a reader (another process, a peer's fetch, a
restarted node) never sees half a slice, a manifest or a cache table."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["written_whole"]


@contextlib.contextmanager
def written_whole(dest: Path, prefix: str = "") -> Iterator[Path]:
    """A temporary path beside ``dest`` to write; renamed onto ``dest`` when the block
    ends, deleted when it raises. A unique name per writer: racing writers never share
    a file, and whichever renames last wins (with identical bytes, for a cut slice)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=prefix or f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise

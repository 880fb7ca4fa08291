from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A fresh set of meshd processes on loopback, all stopped at teardown."""
    with Cluster(tmp_path) as c:
        yield c

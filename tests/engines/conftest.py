"""Fixtures for the engine tests: the API side of real runners, one thread a stage."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .runners import ApiSide


@pytest.fixture
def api() -> Iterator[ApiSide]:
    """The API node's side of the data plane (for tests of real runner processes)."""
    from .runners import ApiSide  # it imports this module's constants

    side = ApiSide()
    yield side
    side.close()


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_stage() -> Iterator[None]:
    """In-process stages share this process's cores: several OpenMP pools on 2 cores
    spin against each other (40x slower). One thread each keeps the tests fast."""
    old = os.environ.get("MESHD_THREADS")
    os.environ["MESHD_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("MESHD_THREADS", None)
    else:
        os.environ["MESHD_THREADS"] = old

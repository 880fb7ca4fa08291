"""Context per instance, end to end: the runners allocate what the instance asks, a
prompt that fits is served and one that does not is a 400 naming the context."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for, wait_serving
from tests.synthetic import write_model

pytestmark = pytest.mark.timeout(400)


def _complete(node: NodeProc, words: int, model: str = DEFAULT_MODEL) -> httpx.Response:
    return httpx.post(node.api + "/v1/completions", timeout=240,
                      json={"model": model, "prompt": "hello" + " hello" * (words - 1),
                            "max_tokens": 2, "temperature": 0})  # fmt: skip


@pytest.fixture(scope="module")
def long_model(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a 64-wide model trained on 8192 tokens (and one on 2048), with
    the default model's tokenizer: a prompt of thousands of tokens is prefilled in a
    second or two (the default model's takes ~40 s on one thread), so the contexts
    asked for can be filled for real."""
    d = tmp_path_factory.mktemp("long-model")
    write_model(d / "long.gguf", model_path, "llama", context=8192)
    write_model(d / "short.gguf", model_path, "llama", context=2048)
    return d


def test_an_instance_serves_the_context_it_was_placed_with(
    cluster: Cluster, long_model: Path
) -> None:
    a = cluster.start("a", extra_args=["--models", str(long_model)])
    # Over the default 4096. Not a round size: the runner allocates what was asked.
    r = httpx.post(a.api + "/v1/instances", timeout=60,
                   json={"model": "long", "nodes": ["a"], "context": 4800})  # fmt: skip
    assert r.status_code == 201, r.text
    inst = wait_serving(a, r.json()["id"])
    assert inst["context"] == 4800
    r = _complete(a, 4700, "long")
    assert r.status_code == 200, r.text[:300]
    assert 4600 < r.json()["usage"]["prompt_tokens"] < 4800
    assert _complete(a, 4900, "long").json()["error"]["code"] == "context_length_exceeded"
    assert httpx.delete(a.api + f"/v1/instances/{inst['id']}", timeout=30).status_code == 200

    # meshctl place --ctx: a small context over two nodes, and a prompt over it is
    # refused, typed.
    b = cluster.start("b", peers=[a], extra_args=["--models", str(long_model)])
    wait_for(lambda: len(b.cluster()["nodes"]) == 2, 15)
    out = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "--node", a.api.removeprefix("http://"),
         "place", "long", "--nodes", "a,b", "--ctx", "1024"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (inst,) = [i for i in a.get("/v1/instances")["data"] if i["context"] == 1024]
    assert len({s["node"] for s in inst["stages"]}) == 2
    wait_serving(a, inst["id"])
    r = _complete(a, 1500, "long")
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "1024" in err["message"]
    assert _complete(a, 900, "long").status_code == 200
    assert httpx.delete(a.api + f"/v1/instances/{inst['id']}", timeout=30).status_code == 200

    # Ollama's num_ctx is the context of the instance a request places.
    wait_for(lambda: not a.get("/v1/instances")["data"], 30)
    r = httpx.post(a.api + "/api/chat", timeout=120, json={
        "model": "long", "stream": False, "messages": [{"role": "user", "content": "Hi"}],
        "options": {"num_ctx": 2048, "num_predict": 2}})  # fmt: skip
    assert r.status_code == 200, r.text
    assert [i["context"] for i in a.get("/v1/instances")["data"]] == [2048]


def test_a_nodes_context_setting_is_what_the_models_it_places_get(
    cluster: Cluster, long_model: Path
) -> None:
    # `meshd up --context`: the model it serves gets it, the runner is started with it,
    # and a prompt over it is refused, typed.
    a = cluster.start("a", model="long", context=3000, extra_args=["--models", str(long_model)])
    inst = wait_for(lambda: next(iter(a.get("/v1/instances")["data"]), None), 30)
    assert inst["context"] == 3000
    wait_serving(a, inst["id"])
    assert "3000 tokens of context" in a.log()
    r = _complete(a, 3100, "long")
    assert r.status_code == 400, r.text[:300]
    assert "3000" in r.json()["error"]["message"]
    # A model trained on less gets its trained context; a placement that says one, it.
    r = httpx.post(a.api + "/v1/instances", timeout=60, json={"model": "short"})
    assert r.status_code == 201 and r.json()["context"] == 2048, r.text
    r = httpx.post(a.api + "/v1/instances", timeout=60, json={"model": "long", "context": 5000})
    assert r.status_code == 201 and r.json()["context"] == 5000, r.text


def test_an_instance_placed_without_a_context_gets_the_longest_its_memory_allows(
    cluster: Cluster,
) -> None:
    # 2.5 GiB usable: the trained 8192 tokens' KV (1.5 GB for 8 requests) is more than
    # the half of it a default context may take, so the instance gets the base 4096.
    small = cluster.start("small", context=None, extra_args=["--max-memory", "3G"])
    r = httpx.post(small.api + "/v1/instances", timeout=60, json={"model": DEFAULT_MODEL})
    assert r.status_code == 201, r.text
    inst = wait_serving(small, r.json()["id"])
    assert inst["context"] == 4096
    r = _complete(small, 4200)
    assert r.status_code == 400 and "4096" in r.json()["error"]["message"], r.text[:300]
    assert httpx.delete(small.api + f"/v1/instances/{inst['id']}", timeout=30).status_code == 200
    # 8 GiB offered: the model's trained context, which its runner is started with (a
    # runner serves what it is started with: the test above fills such a context).
    roomy = cluster.start("roomy", context=None, extra_args=["--max-memory", "8G"])
    r = httpx.post(roomy.api + "/v1/instances", timeout=60,
                   json={"model": DEFAULT_MODEL, "nodes": ["roomy"]})  # fmt: skip
    assert r.status_code == 201, r.text
    inst = wait_serving(roomy, r.json()["id"])
    assert inst["context"] == 8192
    assert f"starting runner {inst['id']} stage 0 [0, 30), 8192 tokens of context" in roomy.log()


def test_an_instance_with_a_quantized_kv_cache_serves(cluster: Cluster) -> None:
    a = cluster.start("a")
    r = httpx.post(a.api + "/v1/instances", timeout=60,
                   json={"model": DEFAULT_MODEL, "kv_cache": "q5_1"})  # fmt: skip
    assert r.status_code == 400 and "kv_cache" in r.json()["error"]["message"]
    out = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "--node", a.api.removeprefix("http://"),
         "place", DEFAULT_MODEL, "--kv-cache", "q8_0", "--ctx", "8192"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (inst,) = a.get("/v1/instances")["data"]
    assert (inst["kv_cache"], inst["context"]) == ("q8_0", 8192)
    wait_serving(a, inst["id"])
    r = _complete(a, 50)
    assert r.status_code == 200, r.text[:300]
    assert "with a q8_0 KV cache" in a.log()

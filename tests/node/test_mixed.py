"""MLX stages and mixed MLX + llama.cpp pipelines, through real runners on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest

from meshd.models.resolve import DEFAULT_MODEL, resolve_model
from tests.cluster import Cluster, NodeProc, wait_for

pytestmark = pytest.mark.timeout(600)

PROMPT = "The capital of France is"
N = 6


def _greedy_whole(engine: str) -> str:
    """Greedy text of the whole model in one in-process stage of ``engine``."""
    from meshd.engines.llama_stage import LlamaStage
    from meshd.engines.mlx_stage import MlxStage
    from meshd.engines.stage import StageInput
    from meshd.engines.threads import default_threads

    path = Path(resolve_model(DEFAULT_MODEL).path)
    if engine == "mlx":
        stage = MlxStage(path, start=0, end=30, first=True, last=True, n_ctx=512, n_seq_max=1)
    else:
        stage = LlamaStage(path, first=True, last=True, n_ctx=512, n_seq_max=1,
                           n_threads=default_threads())  # fmt: skip
    with stage:
        cur = np.asarray(stage.tokenize(PROMPT, add_special=True, parse_special=False), np.int32)
        pos, out = 0, []
        for _ in range(N):
            logits = stage.forward([StageInput(seq=0, pos=pos, tokens=cur)])[0]
            pos += len(cur)
            tok = int(np.argmax(logits))
            out.append(tok)
            cur = np.array([tok], np.int32)
        return b"".join(stage.token_to_piece(t) for t in out).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def wholes() -> dict[str, str]:
    return {e: _greedy_whole(e) for e in ("llama_cpp", "mlx")}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every node of the trio may load models from (``--models``)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def mlx_folder(models_dir: Path) -> Path:
    """The default model as an MLX folder, under the nodes' --models (converted once)."""
    from meshd.models.convert import gguf_to_mlx_folder

    return gguf_to_mlx_folder(Path(resolve_model(DEFAULT_MODEL).path), models_dir / "smol-mlx")


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[list[NodeProc]]:
    with Cluster(tmp_path_factory.mktemp("mixed")) as c:
        roots = ["--models", str(models_dir)]
        a = c.start("a", extra_args=roots)
        b = c.start("b", peers=[a], extra_args=roots)
        cc = c.start("c", peers=[a], extra_args=roots)
        wait_for(lambda: all(len(n.cluster()["nodes"]) == 3 for n in (a, b, cc)), 10)
        yield [a, b, cc]


def _remove(nodes: list[NodeProc], inst_id: str) -> None:
    """Removes an instance (through the first of ``nodes``) and waits until each of
    their views has lost it, so a later test's "changes nothing" compares settled views
    (ci38: one node still listed an instance another had just removed)."""
    httpx.delete(f"{nodes[0].api}/v1/instances/{inst_id}", timeout=10)
    wait_for(lambda: all(inst_id not in {i["id"] for i in n.get("/v1/instances")["data"]}
                         for n in nodes), 10, interval=0.1)  # fmt: skip


def _run(via: NodeProc, nodes: list[NodeProc], engines: list[str], activations: str = "f32") -> str:
    r = httpx.post(via.api + "/v1/instances", timeout=60, json={
        "model": DEFAULT_MODEL, "nodes": [n.name for n in nodes], "engines": engines,
        "activations": activations})  # fmt: skip
    assert r.status_code == 201, r.text
    inst = r.json()
    assert [s["engine"] for s in inst["stages"]] == engines
    assert inst["activations"] == activations
    try:
        wait_for(lambda: all(s["state"] == "ready"
                             for s in via.get(f"/v1/instances/{inst['id']}")["stages"]),
                 120, interval=0.2)  # fmt: skip
        r = httpx.post(via.api + "/v1/completions", timeout=300, json={
            "model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "ignore_eos": True, "exact": True})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    finally:
        _remove([via, *nodes], inst["id"])


@pytest.mark.parametrize("n_stages", [2, 3])
def test_mlx_pipeline_gives_the_whole_mlx_models_greedy_tokens(
    trio: list[NodeProc], wholes: dict[str, str], n_stages: int
) -> None:
    assert _run(trio[0], trio[:n_stages], ["mlx"] * n_stages) == wholes["mlx"]


@pytest.mark.parametrize("activations", ["bf16", "f16"])
def test_mlx_hops_in_half_precision_keep_the_greedy_tokens(
    trio: list[NodeProc], wholes: dict[str, str], activations: str
) -> None:
    assert _run(trio[1], trio[:2], ["mlx", "mlx"], activations) == wholes["mlx"]


def test_an_mlx_folder_splits_over_two_nodes_with_the_ggufs_tokens(
    trio: list[NodeProc], wholes: dict[str, str], mlx_folder: Path
) -> None:
    # Under the nodes' --models: b and c load it though the placement came through a.
    folder = mlx_folder
    r = httpx.post(trio[0].api + "/v1/instances", timeout=60, json={
        "model": str(folder), "nodes": ["b", "c"]})  # fmt: skip
    assert r.status_code == 201, r.text
    inst = r.json()
    assert [s["engine"] for s in inst["stages"]] == ["mlx", "mlx"]
    try:
        wait_for(lambda: all(s["state"] == "ready"
                             for s in trio[0].get(f"/v1/instances/{inst['id']}")["stages"]),
                 120, interval=0.2)  # fmt: skip
        r = httpx.post(trio[2].api + "/v1/completions", timeout=300, json={
            "model": str(folder), "prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "ignore_eos": True, "exact": True})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == wholes["mlx"]
        chat = httpx.post(trio[1].api + "/v1/chat/completions", timeout=300, json={
            "model": str(folder), "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
    finally:
        _remove(trio, inst["id"])


def test_a_folder_of_an_unsupported_architecture_is_a_400(
    trio: list[NodeProc], models_dir: Path, mlx_folder: Path
) -> None:
    import json

    # The converted folder's files (linked, not copied) under a config of another kind.
    folder = models_dir / "odd"
    folder.mkdir()
    for f in mlx_folder.iterdir():
        if f.name != "config.json":
            os.link(f, folder / f.name)
    cfg = json.loads((mlx_folder / "config.json").read_text())
    cfg["model_type"] = cfg["architectures"] = "qwen3_moe"
    (folder / "config.json").write_text(json.dumps(cfg))
    before = trio[0].get("/v1/instances")["data"]
    r = httpx.post(trio[0].api + "/v1/instances", timeout=60, json={"model": str(folder)})
    assert r.status_code == 400, r.text
    assert "qwen3_moe" in r.json()["error"]["message"]
    assert trio[0].get("/v1/instances")["data"] == before


def test_unknown_activation_type_is_a_400(trio: list[NodeProc]) -> None:
    r = httpx.post(trio[0].api + "/v1/instances", timeout=30, json={
        "model": DEFAULT_MODEL, "activations": "f8"})  # fmt: skip
    assert r.status_code == 400 and "activations" in r.text


@pytest.mark.parametrize("engines", [["llama_cpp", "mlx"], ["mlx", "llama_cpp"]])
def test_mixed_pipeline_gives_a_whole_models_greedy_tokens(
    trio: list[NodeProc], wholes: dict[str, str], engines: list[str]
) -> None:
    got = _run(trio[2], trio[:2], engines)
    assert got in (wholes["mlx"], wholes["llama_cpp"]), (got, wholes)


def test_refused_quant_type_gets_a_clear_error_and_changes_nothing(
    trio: list[NodeProc], models_dir: Path
) -> None:
    path = models_dir / "q1_0.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    kind = gguf.GGMLQuantizationType.Q1_0  # neither mx.load nor gguf-py reads it
    block, size = gguf.GGML_QUANT_SIZES[kind]
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((1, 256 // block * size), np.uint8),
                 raw_dtype=kind)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    a = trio[0]
    before = a.get("/v1/instances")["data"]
    r = httpx.post(a.api + "/v1/instances", timeout=30,
                   json={"model": str(path), "nodes": ["a"], "engines": ["mlx"]})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_quant" and "Q1_0" in err["message"]
    assert a.get("/v1/instances")["data"] == before

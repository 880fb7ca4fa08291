"""Weights travel over the mesh: a node placed a stage of a model it lacks fetches that
stage's slice from the nodes that hold the model, verifies it and serves.

Real ``meshd up`` processes on loopback (secured, as a user starts them). Only the
holders have the model, as ``smol.gguf`` under their ``--models`` dir (a link to the
packaged SmolLM2 file: 98 MB, 30 layers); the fetcher has no file of that name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL, resolve_model
from tests.cluster import Cluster, NodeProc, wait_for

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference() -> str:
    """Greedy tokens of llama.cpp on the whole file (as tests/node/test_pipeline.py)."""
    from llama_cpp import Llama

    from meshd.engines.threads import default_threads

    t = default_threads()
    llm = Llama(
        resolve_model(DEFAULT_MODEL).path, n_ctx=4096, flash_attn=False,
        n_threads=t, n_threads_batch=t, verbose=False,
    )  # fmt: skip
    out = llm(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, repeat_penalty=1.0)
    llm.close()
    return out["choices"][0]["text"]


def models_dir(root: Path) -> Path:
    d = root / "models"
    d.mkdir(parents=True)
    (d / "smol.gguf").symlink_to(resolve_model(DEFAULT_MODEL).path)
    return d


def place(via: NodeProc, nodes: list[NodeProc]) -> dict:
    r = httpx.post(
        via.api + "/v1/instances",
        json={"model": "smol", "nodes": [n.name for n in nodes]},
        timeout=60,
    )
    assert r.status_code == 201, r.text
    return r.json()


def runner(node: NodeProc, about: NodeProc, instance: str) -> dict | None:
    """``node``'s runner of ``instance`` as ``about`` reports it in its heartbeat."""
    for m in about.cluster()["nodes"]:
        if m["id"] == node.node_id:
            for r in (m["health"] or {}).get("runners", []):
                if r["instance"] == instance:
                    return r
    return None


def complete(via: NodeProc) -> dict:
    """A greedy completion, exact: compared token for token with the reference."""
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "exact": True}  # fmt: skip
    r = httpx.post(via.api + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def ready(via: NodeProc, inst: dict) -> bool:
    got = via.get(f"/v1/instances/{inst['id']}")
    return all(s["state"] == "ready" for s in got["stages"])


def slices(node: NodeProc) -> list[Path]:
    return sorted((node.data_dir / "cache").glob("*/*.gguf"))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_node_without_the_model_fetches_its_slice_verifies_it_and_serves(
    cluster: Cluster, tmp_path: Path, reference: str
) -> None:
    # a corrupts its first two chunks on the way (a test hook): b must notice and
    # fetch them again. b's slice cache is tiny: the slice in use must stay anyway.
    a = cluster.start(
        "a", extra_args=["--models", str(models_dir(tmp_path / "a"))],
        env={"MESHD_TEST_CORRUPT_CHUNKS": "2"},
    )  # fmt: skip
    b = cluster.start("b", peers=[a], extra_args=["--slice-cache", "1"])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    wait_for(lambda: "smol" in [m["id"] for m in b.get("/v1/models")["data"]], 30)

    # `meshctl place --wait` returns once every stage serves (b's after its fetch).
    r = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "--node", b.api, "place", "smol",
         "--nodes", "a,b", "--wait", "--wait-timeout", "120"],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ready") == 2, r.stdout
    inst = next(i for i in b.get("/v1/instances")["data"] if i["model"] == "smol")
    assert [s["node"] for s in inst["stages"]] == [a.node_id, b.node_id]
    cut = inst["stages"][1]["start"]
    assert ready(b, inst)

    assert complete(b)["choices"][0]["text"] == reference
    assert complete(a)["choices"][0]["text"] == reference

    # b holds exactly its own slice, byte for byte what a cuts for that range.
    mine = slices(b)
    assert [p.name for p in mine] == [f"{cut}-30.gguf"], mine
    theirs = a.data_dir / "cache" / mine[0].parent.name / mine[0].name
    assert theirs.is_file() and sha(theirs) == sha(mine[0])
    assert not list((b.data_dir / "cache").glob("*/*.part"))
    log = b.log()
    assert "failed its sha256" in log and "slice fetched" in log
    # Bad chunks are asked again; the holder is never given up on for them.
    assert "pulling from" not in log and "Traceback" not in log
    assert "smol" not in next(
        n["card"]["models"] for n in b.cluster()["nodes"] if n["id"] == b.node_id
    )


def test_a_holder_killed_mid_transfer_leaves_the_fetch_to_the_other_holder(
    cluster: Cluster, tmp_path: Path, reference: str
) -> None:
    # Two chunks (8 MiB) each half second from each holder: the 65 MB slice takes two
    # seconds from both, four from one, and a is killed as its first chunk lands.
    slow = {"MESHD_TEST_SERVE_DELAY_S": "0.5"}
    a = cluster.start("a", extra_args=["--models", str(models_dir(tmp_path / "a"))], env=slow)
    c = cluster.start(
        "c", peers=[a], extra_args=["--models", str(models_dir(tmp_path / "c"))], env=slow
    )
    b = cluster.start("b", peers=[a])
    nodes = [a, b, c]
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 3 for n in nodes), 15)

    def facts_everywhere() -> bool:
        cards = [n["card"] for n in b.cluster()["nodes"]]
        return sum(any(f["name"] == "smol" for f in k.get("model_facts", [])) for k in cards) == 2

    wait_for(facts_everywhere, 60, interval=0.3)
    inst = place(b, [c, b])
    seen: list[dict] = []

    def fetching_from_both() -> bool:
        r = runner(b, b, inst["id"])
        if r is not None and r.get("state") == "fetching":
            seen.append(r)
        return r is not None and r.get("fetched", 0) > 0

    wait_for(fetching_from_both, 60, interval=0.05)
    os.kill(a.proc.pid, signal.SIGKILL)
    wait_for(lambda: ready(b, inst), 150, interval=0.3)
    assert complete(b)["choices"][0]["text"] == reference
    assert seen and seen[-1]["fetch_total"] > seen[-1]["fetched"] > 0
    mine = slices(b)
    assert len(mine) == 1
    theirs = c.data_dir / "cache" / mine[0].parent.name / mine[0].name
    assert sha(theirs) == sha(mine[0])


def test_while_a_stage_fetches_a_request_gets_503_and_retry_after(
    cluster: Cluster, tmp_path: Path
) -> None:
    slow = {"MESHD_TEST_SERVE_DELAY_S": "1.0"}
    a = cluster.start("a", extra_args=["--models", str(models_dir(tmp_path / "a"))], env=slow)
    b = cluster.start("b", peers=[a], extra_args=["--load-wait", "1"])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    wait_for(lambda: "smol" in [m["id"] for m in b.get("/v1/models")["data"]], 30)
    inst = place(b, [a, b])
    # Once the holder has cut and offered the slice, chunks arrive (slowly).
    wait_for(lambda: (runner(b, b, inst["id"]) or {}).get("fetched", 0) > 0, 60, 0.05)
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(b.api + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert "fetching its weights" in r.json()["error"]["message"]
    assert " MB at " in r.json()["error"]["message"]
    got = b.get(f"/v1/instances/{inst['id']}")
    stage = got["stages"][1]
    assert stage["state"] == "fetching" and stage["fetch_total"] > 0


def test_an_mlx_folder_travels_as_the_folder_of_a_stages_layers(
    cluster: Cluster, tmp_path: Path, model_path: Path
) -> None:
    from meshd.models.convert import gguf_to_mlx_folder

    d = tmp_path / "a" / "models"
    d.mkdir(parents=True)
    gguf_to_mlx_folder(model_path, d / "smol-mlx")
    a = cluster.start("a", extra_args=["--models", str(d)])
    b = cluster.start("b", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)

    def facts_known() -> bool:
        cards = [n["card"] for n in b.cluster()["nodes"]]
        return any(f["name"] == "smol-mlx" for k in cards for f in k.get("model_facts", []))

    wait_for(facts_known, 60, interval=0.3)

    def place_on(nodes: list[NodeProc]) -> dict:
        r = httpx.post(
            b.api + "/v1/instances",
            json={"model": "smol-mlx", "nodes": [n.name for n in nodes],
                  "engines": ["mlx"] * len(nodes)},
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 201, r.text
        inst = r.json()
        wait_for(lambda: ready(b, inst), 180, interval=0.3)
        return inst

    def text() -> str:
        body = {"model": "smol-mlx", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "exact": True}  # fmt: skip
        r = httpx.post(b.api + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    whole = place_on([a])
    expected = text()
    assert httpx.delete(f"{b.api}/v1/instances/{whole['id']}", timeout=10).status_code == 200
    wait_for(lambda: not b.get("/v1/instances")["data"], 15)

    split = place_on([a, b])
    assert [s["node"] for s in split["stages"]] == [a.node_id, b.node_id]
    assert text() == expected
    cut = split["stages"][1]["start"]
    fetched = sorted((b.data_dir / "cache").glob("*/*.mlx"))
    assert [p.name for p in fetched] == [f"{cut}-30.mlx"]
    assert json.loads((fetched[0] / "config.json").read_text())["num_hidden_layers"] == 30 - cut
    assert not list((b.data_dir / "cache").glob("*/*.tar"))  # the archive is unpacked, gone


def test_a_node_holding_another_file_under_the_name_fetches_the_placed_one(
    cluster: Cluster, tmp_path: Path, model_path: Path, reference: str
) -> None:
    other = tmp_path / "b" / "models"
    other.mkdir(parents=True)
    # Same name, another file: the model with its last byte changed (same header and
    # facts, another sha256: only the hash tells them apart).
    shutil.copyfile(model_path, other / "smol.gguf")
    with open(other / "smol.gguf", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    a = cluster.start("a", extra_args=["--models", str(models_dir(tmp_path / "a"))])
    b = cluster.start("b", peers=[a], extra_args=["--models", str(other)])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)

    def both_hashed() -> bool:
        cards = [n["card"] for n in a.cluster()["nodes"]]
        return sum(any(f["name"] == "smol" for f in k.get("model_facts", [])) for k in cards) == 2

    wait_for(both_hashed, 60, interval=0.3)
    inst = place(a, [a, b])  # a's file is the one placed
    wait_for(lambda: ready(a, inst), 120, interval=0.3)
    assert complete(a)["choices"][0]["text"] == reference
    assert len(slices(b)) == 1 and "another file than the placed one" in b.log()

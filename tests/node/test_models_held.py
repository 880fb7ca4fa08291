"""Every node advertises the models it holds: any node lists them and places them.

Two real nodes on loopback; only ``a`` has ``--models DIR``, holding a synthetic GGUF.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster import Cluster, NodeProc, wait_for
from tests.synthetic import write_model

pytestmark = pytest.mark.timeout(180)


def meshctl_models(node: NodeProc) -> list[dict[str, Any]]:
    r = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "--node", node.api, "models", "--json"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def row(rows: list[dict[str, Any]], model: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["model"] == model), None)


def test_a_model_under_models_dir_is_listed_everywhere_and_runs_where_it_is(
    cluster: Cluster, tmp_path: Path, model_path: Path
) -> None:
    d = tmp_path / "models"
    d.mkdir()
    gguf = write_model(d / "synth.gguf", model_path, "llama")
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    a = cluster.start("a", extra_args=["--models", str(d)])
    b = cluster.start("b", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)

    # b has no such file, yet its /v1/models lists it: a holds it.
    wait_for(lambda: "synth" in [m["id"] for m in b.get("/v1/models")["data"]], 15)

    def a_facts() -> dict[str, Any] | None:
        card = next(n["card"] for n in b.cluster()["nodes"] if n["id"] == a.node_id)
        return next((f for f in card.get("model_facts", []) if f["name"] == "synth"), None)

    facts = wait_for(a_facts, 30, interval=0.2)
    assert facts["sha256"] == sha
    assert facts.get("format", "gguf") == "gguf"  # the default is left out of the card
    card_b = next(n["card"] for n in b.cluster()["nodes"] if n["id"] == b.node_id)
    assert "synth" not in card_b["models"]

    listed = wait_for(lambda: row(meshctl_models(b), "synth"), 15)
    assert listed["nodes"] == ["a"] and listed["node_ids"] == [a.node_id]
    assert (listed["format"], listed["sha256"], listed["serving"]) == ("gguf", sha, "")
    assert listed["size"] > 0

    # Asked of b by name: placed on a, the node that holds it, and it answers.
    r = httpx.post(
        b.api + "/v1/completions",
        json={"model": "synth", "prompt": "Hello", "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    inst = next(i for i in b.cluster()["instances"] if i["spec"]["model"] == "synth")
    assert [s["node"] for s in inst["stages"]] == [a.node_id]
    served = row(meshctl_models(b), "synth")
    assert served is not None and served["serving"] == "ready"
    assert served["instances"] == [inst["id"]]


def test_a_model_caught_while_it_is_copied_in_gets_its_facts_once_whole(
    cluster: Cluster, tmp_path: Path, model_path: Path
) -> None:
    # The first look finds the name but no model yet (a copy in progress); the facts
    # come at a later look, once the file is whole, though the name list is unchanged.
    d = tmp_path / "models"
    d.mkdir()
    whole = write_model(tmp_path / "whole.gguf", model_path, "llama")
    (d / "synth.gguf").write_bytes(whole.read_bytes()[:100])
    a = cluster.start("a", extra_args=["--models", str(d), "--models-rescan", "0.5"])

    def synth_facts() -> list[dict[str, Any]]:
        card = a.cluster()["nodes"][0]["card"]
        return [f for f in card.get("model_facts", []) if f["name"] == "synth"]

    card = wait_for(lambda: (c := a.cluster()["nodes"][0]["card"]).get("model_facts") and c, 15)
    assert "synth" in card["models"] and not synth_facts()

    shutil.copyfile(whole, d / "synth.gguf")
    sha = hashlib.sha256(whole.read_bytes()).hexdigest()
    facts = wait_for(synth_facts, 15)
    assert [f["sha256"] for f in facts] == [sha]


def test_a_model_that_lands_in_the_hf_cache_after_start_is_listed_and_served(
    cluster: Cluster, tmp_path: Path, model_path: Path
) -> None:
    # What `meshctl pull` leaves behind: a snapshot in the hub cache layout.
    hub = tmp_path / "hub"
    hub.mkdir()
    a = cluster.start("a", env={"HF_HUB_CACHE": str(hub)}, extra_args=["--models-rescan", "0.5"])
    b = cluster.start("b", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    assert "org/tiny-GGUF" not in [m["id"] for m in b.get("/v1/models")["data"]]

    repo = hub / "models--org--tiny-GGUF"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    write_model(snap / "tiny-Q8_0.gguf", model_path, "llama")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")

    wait_for(lambda: "org/tiny-GGUF" in [m["id"] for m in b.get("/v1/models")["data"]], 20)
    listed = wait_for(
        lambda: (r := row(meshctl_models(b), "org/tiny-GGUF")) and r["sha256"] and r, 30
    )
    assert listed["nodes"] == ["a"]
    r = httpx.post(
        b.api + "/v1/completions",
        json={"model": "org/tiny-GGUF", "prompt": "Hello", "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    # Gone from the disk: gone from every node's list.
    shutil.rmtree(repo)
    wait_for(
        lambda: all("org/tiny-GGUF" not in n["card"]["models"] for n in b.cluster()["nodes"]), 20
    )

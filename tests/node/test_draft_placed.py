"""A placed draft model drafts for the models that share its tokens.

A real node on loopback serves the default model; a small model with the same
tokenizer is placed beside it. The node picks it as the default model's draft model
(``GET /v1/instances`` says so), its runner drafts for a speculating request (its
node's ``/metrics`` count the tokens), and once it is removed, requests go on without.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for
from tests.synthetic import write_model

pytestmark = pytest.mark.timeout(240)

PROMPT = "Tell me about the weather in Lisbon, the food in Porto and trains to Madrid."


def _instances(node: NodeProc) -> dict[str, dict]:
    return {i["model"]: i for i in node.get("/v1/instances")["data"]}


def _drafted(node: NodeProc, instance: str) -> float:
    text = httpx.get(node.api + "/metrics", timeout=5).text
    m = re.search(rf'^meshd_draft_model_tokens{{instance="{instance}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _ask(node: NodeProc, speculate: bool) -> dict:
    body = {
        "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 60, "temperature": 0, "ignore_eos": True, "speculate": speculate,
    }  # fmt: skip
    r = httpx.post(node.api + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_placed_draft_model_drafts_for_the_default_model(
    cluster: Cluster, model_path: Path, tmp_path: Path
) -> None:
    d = tmp_path / "models"
    d.mkdir()
    write_model(d / "synth.gguf", model_path, "llama")  # the default model's tokenizer
    a = cluster.start("a", model=DEFAULT_MODEL, extra_args=["--models", str(d)])
    wait_for(lambda: DEFAULT_MODEL in _instances(a), 60, interval=0.3)
    r = httpx.post(a.api + "/v1/instances", json={"model": "synth"}, timeout=120)
    assert r.status_code == 201, r.text
    draft_id = r.json()["id"]

    def drafting() -> bool:
        return _instances(a)[DEFAULT_MODEL].get("draft") == draft_id

    wait_for(drafting, 90, interval=0.3)
    assert _instances(a)["synth"].get("draft") is None  # nothing smaller shares its tokens
    ls = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "--node", a.api, "ls"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert ls.returncode == 0, ls.stderr
    row = next(line for line in ls.stdout.splitlines() if DEFAULT_MODEL in line)
    assert "draft" in ls.stdout.splitlines()[0] and draft_id in row, ls.stdout

    out = _ask(a, speculate=True)
    assert out["usage"]["completion_tokens"] == 60
    wait_for(lambda: _drafted(a, draft_id) > 0, 10, interval=0.2)

    assert httpx.delete(a.api + f"/v1/instances/{draft_id}", timeout=30).status_code == 200
    wait_for(lambda: _instances(a)[DEFAULT_MODEL].get("draft") is None, 30, interval=0.3)
    assert _ask(a, speculate=True)["usage"]["completion_tokens"] == 60


def test_a_killed_draft_node_leaves_the_stream_whole(
    cluster: Cluster, model_path: Path, tmp_path: Path
) -> None:
    # The draft model on another node dies mid-answer (SIGKILL): the steps waiting for
    # its proposals run without them, and the answer comes whole.
    d = tmp_path / "models"
    d.mkdir()
    write_model(d / "synth.gguf", model_path, "llama")
    a = cluster.start("a", model=DEFAULT_MODEL)
    b = cluster.start("b", peers=[a], extra_args=["--models", str(d)])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    wait_for(lambda: DEFAULT_MODEL in _instances(a), 60, interval=0.3)

    # a places synth from the facts in b's card: wait until that card has come.
    def b_facts() -> bool:
        card = next(n["card"] for n in a.cluster()["nodes"] if n["id"] == b.node_id)
        return any(f["name"] == "synth" for f in card.get("model_facts", []))

    wait_for(b_facts, 30, interval=0.2)
    r = httpx.post(a.api + "/v1/instances", json={"model": "synth", "nodes": ["b"]}, timeout=120)
    assert r.status_code == 201, r.text
    draft_id = r.json()["id"]
    wait_for(lambda: _instances(a)[DEFAULT_MODEL].get("draft") == draft_id, 90, interval=0.3)

    body = {
        "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 300, "temperature": 0, "ignore_eos": True, "speculate": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    pieces, usage = 0, None
    with httpx.stream("POST", a.api + "/v1/chat/completions", json=body, timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                pieces += 1
                if pieces == 20:
                    b.kill()
    assert pieces > 20 and not b.alive()
    assert usage is not None and usage["completion_tokens"] == 300, usage
    assert _ask(a, speculate=True)["usage"]["completion_tokens"] == 60  # the next one too

"""meshctl place / ls / rm / chat, and /metrics, against a real node serving a real model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for

pytestmark = pytest.mark.timeout(180)


def meshctl(node: NodeProc, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "--node", node.api, *args],
        capture_output=True, text=True, timeout=90, input=stdin,
    )  # fmt: skip


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    """One node that serves nothing until a test places something."""
    with Cluster(Path(tmp_path_factory.mktemp("ctl"))) as c:
        yield c.start("solo")


def instances(node: NodeProc) -> list[dict]:
    r = meshctl(node, "ls", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def greedy_chat(node: NodeProc, messages: list[dict]) -> str:
    """The API's greedy answer, exact (compared with meshctl chat's, exact too)."""
    body = {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 24, "temperature": 0,
            "exact": True}  # fmt: skip
    r = httpx.post(node.api + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_place_with_a_node_count_ls_chat_and_rm(node: NodeProc) -> None:
    r = meshctl(node, "place", DEFAULT_MODEL, "--nodes", "1")
    assert r.returncode == 0, r.stderr
    placed = instances(node)
    assert len(placed) == 1 and placed[0]["model"] == DEFAULT_MODEL
    (stage,) = placed[0]["stages"]
    assert stage["node"] == node.node_id and stage["start"] == 0
    wait_for(lambda: instances(node)[0]["stages"][0]["state"] == "ready", 60, interval=0.3)
    table = meshctl(node, "ls")
    assert table.returncode == 0 and "ready" in table.stdout and placed[0]["id"] in table.stdout

    # One-shot chat streams exactly what the API answers for the same greedy request.
    r = meshctl(node, "chat", "--max-tokens", "24", "--temperature", "0", "--exact",
                "Name a colour.")  # fmt: skip
    assert r.returncode == 0, r.stderr
    want = greedy_chat(node, [{"role": "user", "content": "Name a colour."}])
    assert r.stdout.rstrip("\n") == want

    # The interactive session keeps the history: its second answer is the API's answer
    # to the whole two-turn conversation.
    r = meshctl(
        node, "chat", "--max-tokens", "24", "--temperature", "0", "--exact",
        stdin="Name a colour.\n\nAnd another one?\n",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    second = greedy_chat(
        node,
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": want},
            {"role": "user", "content": "And another one?"},
        ],
    )
    assert f"> {want}\n" in r.stdout
    assert f"> {second}\n" in r.stdout

    # /metrics carries what the requests above did.
    text = httpx.get(node.api + "/metrics", timeout=5).text
    for name in (
        "meshd_requests_total", "meshd_prompt_tokens_total", "meshd_completion_tokens_total",
        "meshd_time_to_first_token_seconds_count", "meshd_inter_token_seconds_count",
        "meshd_stage_compute_seconds_count", "meshd_pipeline_overhead_seconds_count",
    ):  # fmt: skip
        m = re.search(rf"^{name}{{[^}}]*model=\"{DEFAULT_MODEL}\"[^}}]*}} (\S+)$", text, re.M)
        assert m and float(m.group(1)) > 0, f"{name} missing or zero"

    r = meshctl(node, "rm", placed[0]["id"])
    assert r.returncode == 0, r.stderr
    assert instances(node) == []
    assert "no instances placed" in meshctl(node, "ls").stdout


def test_interactive_chat_survives_a_failed_turn(node: NodeProc) -> None:
    r = meshctl(node, "chat", "--model", "no-such-model", stdin="hello\nagain\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("no-such-model") >= 2  # each turn said why, the session went on
    assert "Traceback" not in r.stderr


def test_place_errors_are_typed_and_change_nothing(node: NodeProc) -> None:
    before = instances(node)
    r = meshctl(node, "place", DEFAULT_MODEL, "--nodes", "nobody")
    assert r.returncode == 1 and "nobody" in r.stderr
    r = meshctl(node, "place", DEFAULT_MODEL, "--nodes", "3")  # one node cannot be three
    assert r.returncode == 1 and r.stderr.strip()
    # The owner keeps the model off the one node there is: nowhere left to place it.
    r = meshctl(node, "place", DEFAULT_MODEL, "--exclude", "solo")
    assert r.returncode == 1 and "no live node" in r.stderr, r.stderr
    r = meshctl(node, "rm", "no-such-instance")
    assert r.returncode == 1
    assert instances(node) == before

"""meshctl against a real 3-node cluster."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(60)


def _meshctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", *args],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_meshctl_top_once_shows_all_three_nodes(cluster: Cluster) -> None:
    a = cluster.start("alpha")
    b = cluster.start("bravo", peers=[a])
    c = cluster.start("charlie", peers=[a])
    wait_for(lambda: len(c.cluster()["nodes"]) == 3 and len(b.cluster()["nodes"]) == 3, 5)
    wait_for(lambda: set(c.liveness().values()) == {"alive"}, 5)
    r = _meshctl("--node", c.api.removeprefix("http://"), "top", "--once")
    assert r.returncode == 0, r.stderr
    for name in ("alpha", "bravo", "charlie"):
        assert name in r.stdout
    assert r.stdout.count("alive") >= 3

    r = _meshctl("--node", a.api.removeprefix("http://"), "nodes", "--json")
    assert r.returncode == 0, r.stderr
    nodes = json.loads(r.stdout)
    assert {n["name"] for n in nodes} == {"alpha", "bravo", "charlie"}
    assert {n["id"] for n in nodes} == {a.node_id, b.node_id, c.node_id}


def test_meshctl_reports_an_unreachable_node_without_a_traceback() -> None:
    r = _meshctl("--node", "127.0.0.1:1", "nodes")
    assert r.returncode == 2
    assert "cannot reach meshd node" in r.stderr
    assert "Traceback" not in r.stderr

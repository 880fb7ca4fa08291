"""Several real `meshd up` processes on loopback: convergence, death, rejoin, leave."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from tests.cluster import Cluster, NodeProc, wait_for

pytestmark = pytest.mark.timeout(90)


def _view(n: NodeProc) -> dict[str, tuple[str, str]]:
    """Node id -> (name, incarnation) as ``n`` sees the cluster."""
    return {m["id"]: (m["name"], m["card"]["incarnation"]) for m in n.cluster()["nodes"]}


def _three(cluster: Cluster) -> list[NodeProc]:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a], wait=False)
    c = cluster.start("c", peers=[a], wait=False)
    cluster.wait_ready(b)
    cluster.wait_ready(c)
    return [a, b, c]


def _all_agree(nodes: list[NodeProc]) -> bool:
    views = [_view(n) for n in nodes]
    ids = {n.node_id for n in nodes}
    if any(set(v) != ids for v in views) or any(v != views[0] for v in views):
        return False
    return all(set(n.liveness().values()) == {"alive"} for n in nodes)


def test_three_nodes_with_static_peers_converge_within_2s(cluster: Cluster) -> None:
    nodes = _three(cluster)
    t0 = time.monotonic()
    wait_for(lambda: _all_agree(nodes), timeout=2.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0
    # c only knows a; it must have learned b (and b, c) through gossip.
    c_view = _view(nodes[2])
    assert nodes[1].node_id in c_view


def test_sigkilled_node_is_dead_within_3s_and_rejoins_under_same_id(cluster: Cluster) -> None:
    a, b, c = _three(cluster)
    wait_for(lambda: _all_agree([a, b, c]), timeout=5.0)
    old_id, old_inc = c.node_id, _view(a)[c.node_id][1]
    c.kill()
    t0 = time.monotonic()
    wait_for(lambda: a.liveness()["c"] == "dead" and b.liveness()["c"] == "dead", timeout=3.0)
    assert time.monotonic() - t0 < 3.0

    c2 = cluster.restart(c)
    assert c2.node_id == old_id
    wait_for(lambda: _all_agree([a, b, c2]), timeout=5.0)
    # Same id, new incarnation: the cluster saw a restart, not a stranger.
    assert _view(b)[old_id][1] != old_inc
    assert len(a.cluster()["nodes"]) == 3


def test_clean_stop_is_seen_as_left_without_waiting_for_the_timeout(cluster: Cluster) -> None:
    a, b, c = _three(cluster)
    wait_for(lambda: _all_agree([a, b, c]), timeout=5.0)
    assert b.terminate() == 0
    t0 = time.monotonic()
    wait_for(lambda: a.liveness()["b"] == "left" and c.liveness()["b"] == "left", timeout=1.0)
    # Well under the 2 s a silent death takes to be declared.
    assert time.monotonic() - t0 < 1.0


def test_node_of_another_cluster_is_refused(cluster: Cluster, tmp_path) -> None:
    a = cluster.start("a")
    other = Cluster(tmp_path / "other", cluster="other")
    try:
        x = other.start("x", peers=[a])
        time.sleep(2.5)
        assert set(a.liveness()) == {"a"}
        assert set(x.liveness()) == {"x"}
        assert a.get("/healthz")["dropped"]["mesh"]["wrong_cluster"] >= 1
    finally:
        other.close()


def test_second_process_on_same_data_dir_is_refused(cluster: Cluster) -> None:
    a = cluster.start("a")
    r = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshd", "up", "--no-discovery",
         "--api-port", "0", "--mesh-port", "0", "--data-dir", str(a.data_dir)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode != 0
    assert "another meshd process" in r.stderr


def test_copied_data_dir_gets_a_new_id_not_a_duplicate(cluster: Cluster, tmp_path) -> None:
    a = cluster.start("a")
    copy = tmp_path / "copied"
    shutil.copytree(a.data_dir, copy, ignore=shutil.ignore_patterns("meshd.lock"))
    b = cluster.start("b", peers=[a], data_dir=copy)
    assert b.node_id != a.node_id
    wait_for(lambda: _all_agree([a, b]), timeout=3.0)

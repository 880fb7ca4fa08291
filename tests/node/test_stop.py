"""Stopping: a node with no request in flight stops at once, whether its instance can
move or not; the drain waits only for requests, and its log says what it waits for."""

from __future__ import annotations

import time

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for

pytestmark = pytest.mark.timeout(180)


def _place(via: NodeProc, names: list[str]) -> str:
    r = httpx.post(via.api + "/v1/instances", timeout=60,
                   json={"model": DEFAULT_MODEL, "nodes": names})  # fmt: skip
    assert r.status_code == 201, r.text
    iid = r.json()["id"]
    wait_for(lambda: all(s["state"] == "ready" for s in via.get(f"/v1/instances/{iid}")["stages"]),
             120, 0.2)  # fmt: skip
    return iid


def _stop_time(node: NodeProc) -> float:
    t0 = time.monotonic()
    assert node.terminate(timeout=60) == 0
    return time.monotonic() - t0


def test_an_idle_node_whose_instance_cannot_move_stops_at_once(cluster: Cluster) -> None:
    # a offers too little memory for the whole model at the memory-chosen context
    # (8192 tokens): without b it has nowhere to go.
    a = cluster.start("a", context=None, extra_args=["--max-memory", "900M"])
    b = cluster.start("b", peers=[a])
    wait_for(lambda: len(b.cluster()["nodes"]) == 2, 15)
    _place(a, ["a", "b"])
    took = _stop_time(b)
    assert took < 3.0, f"stopped after {took:.2f} s"
    assert "no request in flight, stopping now" in b.log()


def test_an_idle_node_whose_instance_could_move_stops_at_once_too(cluster: Cluster) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    wait_for(lambda: len(b.cluster()["nodes"]) == 2, 15)
    iid = _place(a, ["a", "b"])
    took = _stop_time(b)
    assert took < 3.0, f"stopped after {took:.2f} s"
    # The peer repairs what b held, and serves.
    wait_for(lambda: {s["node"] for s in a.get(f"/v1/instances/{iid}")["stages"]} == {a.node_id}
             and all(s["state"] == "ready" for s in a.get(f"/v1/instances/{iid}")["stages"]),
             60, 0.2)  # fmt: skip
    r = httpx.post(a.api + "/v1/completions", timeout=60,
                   json={"model": DEFAULT_MODEL, "prompt": "Hi", "max_tokens": 4})  # fmt: skip
    assert r.status_code == 200, r.text

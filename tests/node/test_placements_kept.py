"""Placements survive a whole-house restart, with their settings, and a removal is for
good: real nodes, SIGKILLed (a power cut) and started again on their data dirs."""

from __future__ import annotations

import json

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from meshd.node.kept import PLACEMENTS_FILE
from tests.cluster import Cluster, NodeProc, wait_for, wait_serving

pytestmark = pytest.mark.timeout(240)

#: The settings a restore must bring back (the node's own --context is TEST_CONTEXT).
SETTINGS = {"context": 512, "kv_cache": "q8_0", "speculate": False, "exact": True}


def _kept(n: NodeProc) -> dict:
    try:
        return json.loads((n.data_dir / PLACEMENTS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _place(n: NodeProc, **body: object) -> str:
    r = httpx.post(n.api + "/v1/instances", json={"model": DEFAULT_MODEL, **body}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _ids(n: NodeProc) -> set[str]:
    return {i["id"] for i in n.get("/v1/instances")["data"]}


def test_placements_come_back_after_a_power_cut_and_a_removal_stays(cluster: Cluster) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    wait_for(lambda: len(a.cluster()["nodes"]) == 2, 15)
    x = _place(a, nodes=["a", "b"], **SETTINGS)
    y = _place(a, nodes=["a"])
    assert httpx.delete(f"{a.api}/v1/instances/{y}", timeout=30).status_code == 200
    for n in (a, b):
        wait_for(lambda n=n: set(_kept(n).get("instances", {})) == {x}
                 and y in _kept(n).get("removed", {}), 15)  # fmt: skip

    # A power cut: every node at once, no goodbye. Back: X as it was, Y not.
    a.kill()
    b.kill()
    a, b = cluster.restart(a), cluster.restart(b)
    inst = wait_for(lambda: a.get(f"/v1/instances/{x}"), 60)
    assert {k: inst[k] for k in SETTINGS} == SETTINGS
    assert [s["node"] for s in inst["stages"]] == [a.node_id, b.node_id]
    wait_serving(a, x)
    assert y not in _ids(a) | _ids(b)
    r = httpx.post(a.api + "/v1/completions", timeout=60,
                   json={"model": DEFAULT_MODEL, "prompt": "Hi", "max_tokens": 3})  # fmt: skip
    assert r.status_code == 200, r.text

    # Removed while b was down: b, back first and alone, places X again from its file
    # once a is there; a, which saw the removal, deletes that copy, and both forget X.
    b.kill()
    assert httpx.delete(f"{a.api}/v1/instances/{x}", timeout=30).status_code == 200
    wait_for(lambda: x in _kept(a).get("removed", {}), 15)
    a.kill()
    b = cluster.restart(b)
    a = cluster.restart(a)
    wait_for(lambda: "deleting the copy placed again" in a.log(), 60)
    for n in (a, b):
        wait_for(lambda n=n: x not in _ids(n) and x not in _kept(n).get("instances", {}), 30)

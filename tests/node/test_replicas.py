"""Replicas: several instances of one model share the requests, least busy first.

Two real nodes on loopback, the default model placed twice: each replica on its own
node, and a burst of concurrent requests through one node's API spread evenly.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(240)


def test_two_replicas_take_a_burst_of_requests_in_turn(cluster: Cluster) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    r = httpx.post(a.api + "/v1/instances", json={"model": DEFAULT_MODEL, "replicas": 2},
                   timeout=120)  # fmt: skip
    assert r.status_code == 201, r.text
    placed = r.json()["data"]
    assert len(placed) == 2
    nodes = [{s["node"] for s in i["stages"]} for i in placed]
    assert not nodes[0] & nodes[1], nodes  # each on a node of its own
    ids = [i["id"] for i in placed]

    def ready() -> bool:
        return all(
            s["state"] == "ready" for i in ids for s in a.get(f"/v1/instances/{i}")["stages"]
        )

    wait_for(ready, 120, interval=0.3)

    samples: list[dict[str, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            got = a.get("/v1/instances")["data"]
            samples.append({i["id"]: i["in_flight"] for i in got if i["id"] in ids})
            time.sleep(0.02)

    def ask(k: int) -> int:
        body = {"model": DEFAULT_MODEL, "prompt": f"Story {k}:", "max_tokens": 40,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        return httpx.post(a.api + "/v1/completions", json=body, timeout=180).status_code

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(ask, range(8)))
    finally:
        stop.set()
        watcher.join()
    assert codes == [200] * 8
    # Routing decides where each request goes as it arrives: from the first request
    # until the first one ends (then the faster replica simply empties first).
    busy, peak = [], 0
    for sm in samples:
        n = sum(sm.values())
        if n < peak:
            break
        if n:
            busy.append(sm)
        peak = max(peak, n)
    assert busy and peak == 8, samples[:20]
    assert all(abs(sm.get(ids[0], 0) - sm.get(ids[1], 0)) <= 1 for sm in busy), busy
    assert busy[-1] == {ids[0]: 4, ids[1]: 4}

"""Killed runners and killed nodes: no request hangs, placements repair themselves."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from meshd.engines.models import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for
from tests.node.test_pipeline import place

pytestmark = pytest.mark.timeout(240)


def _runner_pids(instance: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"meshd.engines.runner.*{instance}"],
                         capture_output=True, text=True).stdout  # fmt: skip
    return [int(x) for x in out.split()]


def _complete(n: NodeProc, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(
        n.api + "/v1/completions",
        json={"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
              "temperature": 0},
        timeout=60,
    )  # fmt: skip


def test_sigkilled_runner_is_restarted_and_the_node_stays_up(cluster: Cluster) -> None:
    a = cluster.start("a")
    inst = place(a, [a])
    before = _complete(a).json()["choices"][0]["text"]
    (pid,) = _runner_pids(inst["id"])
    os.kill(pid, signal.SIGKILL)
    assert a.get("/healthz")["status"] == "ok"

    def serving_again() -> bool:
        pids = _runner_pids(inst["id"])
        st = a.get(f"/v1/instances/{inst['id']}")["stages"][0]["state"]
        return bool(pids) and pids[0] != pid and st == "ready"

    wait_for(serving_again, 30, interval=0.1)
    assert _complete(a).json()["choices"][0]["text"] == before
    assert a.alive()


def test_killed_middle_node_ends_the_stream_within_2s_and_the_instance_is_repaired(
    cluster: Cluster,
) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    c = cluster.start("c", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 3 for n in (a, b, c)), 10)
    inst = place(a, [a, b, c])
    events: list[tuple[float, str]] = []

    def stream() -> None:
        body = {"model": DEFAULT_MODEL, "prompt": "Tell a story.", "max_tokens": 3000,
                "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", a.api + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line))

    t = threading.Thread(target=stream)
    t.start()
    wait_for(lambda: len(events) >= 10, 30, interval=0.05)
    b.kill()
    killed = time.monotonic()
    t.join(10)
    assert not t.is_alive(), "stream still open 10 s after the kill"
    assert events[-1][1] == "data: [DONE]"
    err_at, err = events[-2]
    assert '"error"' in err and "stage_lost" in err, err
    assert err_at - killed < 2.0, f"ended {err_at - killed:.2f} s after the kill"

    # Every survivor computes the same repair: generation 2, without b, serving again.
    def repaired() -> bool:
        views = [n.get(f"/v1/instances/{inst['id']}") for n in (a, c)]
        return all(
            v["generation"] >= 2
            and b.node_id not in {s["node"] for s in v["stages"]}
            and all(s["state"] == "ready" for s in v["stages"])
            for v in views
        ) and views[0]["stages"] == views[1]["stages"]  # fmt: skip

    try:
        wait_for(repaired, 30, interval=0.2)
    except TimeoutError:
        raise AssertionError(
            f"not repaired: {a.get('/v1/instances')}\n--- a ---\n{a.log()}\n--- c ---\n{c.log()}"
        ) from None
    r = _complete(c)
    assert r.status_code == 200, r.text

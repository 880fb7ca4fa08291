"""A request's id: in its response header, on every log line written for it, and in the
pipeline ids its stages log under, so one grep over the nodes' logs shows its path."""

from __future__ import annotations

import json

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(180)


def test_a_request_id_follows_the_request_through_the_logs(cluster: Cluster) -> None:
    a = cluster.start("a", extra_args=["--log-format", "json"])
    b = cluster.start("b", peers=[a])
    wait_for(lambda: len(b.cluster()["nodes"]) == 2, 15)
    r = httpx.post(a.api + "/v1/instances", timeout=60,
                   json={"model": DEFAULT_MODEL, "nodes": ["a", "b"]})  # fmt: skip
    assert r.status_code == 201, r.text
    iid = r.json()["id"]
    wait_for(lambda: all(s["state"] == "ready" for s in a.get(f"/v1/instances/{iid}")["stages"]),
             120, 0.2)  # fmt: skip
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5, "temperature": 0}  # fmt: skip
    # An id the client chose comes back and tags the node's lines.
    r = httpx.post(b.api + "/v1/chat/completions", json=body, timeout=60,
                   headers={"X-Request-Id": "client-id-42"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-42"
    wait_for(lambda: "req=client-id-42" in b.log(), 5)
    (line,) = [ln for ln in b.log().splitlines() if "req=client-id-42" in ln]
    assert "chat smollm2-135m via a:0-" in line and "> b:" in line and ": 200, " in line
    # Without one the node makes one; a refusal carries it too.
    r = httpx.post(b.api + "/v1/chat/completions", json={**body, "model": "nope"}, timeout=30)
    assert r.status_code == 404 and len(r.headers["x-request-id"]) == 16
    # A request that fails at a stage: the stage's runner logs it under the API's id.
    long = {**body, "messages": [{"role": "user", "content": "word " * 9000}]}
    r = httpx.post(b.api + "/v1/chat/completions", json=long, timeout=60,
                   headers={"X-Request-Id": "too-long-7"})  # fmt: skip
    assert r.status_code == 400, r.text

    # Stage 0 is on a, whose log is JSON: its runner's line names the request.
    def stage_line() -> dict | None:
        for ln in a.log().splitlines():
            if ln.startswith("{") and "too-long-7" in ln:
                return json.loads(ln)
        return None

    wait_for(lambda: stage_line() is not None, 5)
    got = stage_line()
    assert got["req"].startswith("too-long-7.") and "context_length_exceeded" in got["msg"]
    assert got["proc"].startswith("runner")

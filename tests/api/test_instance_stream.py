"""``GET /v1/instances`` and ``GET /v1/instances/stream`` against real nodes: the node's
own view of each instance, behind the API key, streamed at once and again at every
change; a node that gave up on an instance shows as excluded, with its reason, in the
stream and in ``meshctl top``'s frame drawn from it. And the stream's pace, in this
process, over a stand-in of its node: no repeats, keep-alives, the end at a drain.

Node a guards its API with a key; node b may not load the model a plan gives it (a file
outside its roots), so it gives its runner up (``model not available here``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from meshd.api import instances as instances_api
from meshd.api import snapshots
from meshd.api.sse import SSE_KEEPALIVE
from meshd.cli.top import render
from meshd.models import DEFAULT_MODEL, resolve_model
from meshd.node.cluster import MODEL_MISSING, ClusterView
from tests.cluster import Cluster, NodeProc, wait_for
from tests.node.test_cluster_view import card, inst

pytestmark = pytest.mark.timeout(90)

KEY = "sk-test-instance-view"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def a_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Node a's ``--models`` folder (no other node's)."""
    return tmp_path_factory.mktemp("a-models")


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, a_models: Path
) -> Iterator[tuple[NodeProc, NodeProc]]:
    """Node a (its API behind ``KEY``) and node b, in one cluster."""
    with Cluster(tmp_path_factory.mktemp("instance-view")) as c:
        a = c.start("a", env={"MESHD_API_KEY": KEY}, extra_args=["--models", str(a_models)])
        b = c.start("b", peers=[a])
        wait_for(lambda: len(b.cluster()["nodes"]) == 2, 15)
        yield a, b


@pytest.fixture
def gguf(a_models: Path) -> Path:
    """The default model under a's roots, outside b's."""
    try:
        src = Path(resolve_model(DEFAULT_MODEL).path)
    except LookupError:
        pytest.skip("the default model is not installed")
    out = a_models / "smol.gguf"
    if out.exists():
        return out
    os.link(src, out) if src.stat().st_dev == out.parent.stat().st_dev else shutil.copy(src, out)
    return out


def _api(n: NodeProc) -> str:
    return n.api.replace("0.0.0.0", "127.0.0.1")  # a key makes it listen on all


def _events(resp: httpx.Response, within: float) -> Iterator[dict[str, Any]]:
    """The JSON of each ``data:`` event, for ``within`` seconds at most."""
    deadline = time.monotonic() + within
    for line in resp.iter_lines():
        if time.monotonic() > deadline:
            break
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))
    raise AssertionError(f"no such event within {within} s")


def _find(events: Iterator[dict[str, Any]], pred: Any) -> dict[str, Any]:
    return next(e for e in events if pred(e))


def test_the_view_and_its_stream_need_the_key(pair: tuple[NodeProc, NodeProc]) -> None:
    a, _ = pair
    for path in ("/v1/instances", "/v1/instances/stream"):
        r = httpx.get(_api(a) + path, timeout=5)
        assert r.status_code == 401, r.text
    r = httpx.get(_api(a) + "/v1/instances", headers=AUTH, timeout=5)
    assert r.status_code == 200 and r.json() == {"object": "list", "data": []}


def test_the_stream_sends_the_list_then_each_change_and_top_shows_who_gave_up(
    pair: tuple[NodeProc, NodeProc], gguf: Path
) -> None:
    a, b = pair
    url = _api(a)
    with httpx.stream("GET", url + "/v1/instances/stream", headers=AUTH, timeout=10) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        events = _events(s, within=60)
        assert next(events) == {"object": "list", "data": []}  # at once
        # A plan putting the model on b, which may not load it: b gives its runner up.
        r = httpx.post(url + "/v1/instances", headers=AUTH, timeout=60,
                       json={"model": str(gguf), "nodes": ["b"]})  # fmt: skip
        assert r.status_code == 201, r.text
        placed = r.json()
        iid = placed["id"]
        assert placed["object"] == "instance" and placed["stages"][0]["name"] == "b"
        first = _find(events, lambda e: [i["id"] for i in e["data"]] == [iid])
        assert first["data"][0]["model"] == str(gguf)
        excluded = _find(events, lambda e: e["data"] and e["data"][0]["excluded"])
        (inst,) = excluded["data"]
        assert inst["excluded"] == [{"node": b.node_id, "name": "b", "stage": 0,
                                     "generation": 1, "reason": MODEL_MISSING}]  # fmt: skip
        # The node's own answer and `meshctl top`'s frame say the same.
        listed = httpx.get(f"{url}/v1/instances/{iid}", headers=AUTH, timeout=5).json()
        assert listed["excluded"] == inst["excluded"]
        cluster = httpx.get(url + "/v1/cluster", headers=AUTH, timeout=5).json()
        out = io.StringIO()
        Console(file=out, width=200).print(render(cluster, excluded["data"]))
        assert f"excluded b ({MODEL_MISSING})" in out.getvalue(), out.getvalue()
        # Deleting it is the next change the stream tells.
        assert httpx.delete(f"{url}/v1/instances/{iid}", headers=AUTH, timeout=10).is_success
        _find(events, lambda e: e["data"] == [])


class _Node:
    """What the stream reads of its node: the view, the load, whether it drains, and a
    wait for a change (none comes: each wait lasts its whole timeout, on ``clock``)."""

    def __init__(self, view: ClusterView) -> None:
        self.now = 0.0
        self.current = view
        self.draining = False

    def view(self) -> ClusterView:
        return self.current

    def instance_load(self) -> dict[str, int]:
        return {}

    async def changed(self, timeout: float) -> bool:
        await asyncio.sleep(0)
        self.now += timeout
        return False


async def test_the_stream_sends_a_list_once_keeps_alive_while_quiet_and_ends_at_a_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(snapshots, "STREAM_MIN_INTERVAL_S", 0.0)
    empty = ClusterView("a", {"a": card("a")}, {}, {}, {"a": "alive"}, {"a": 0.0})
    node = _Node(empty)
    stream = instances_api.instance_snapshots(node, clock=lambda: node.now)  # type: ignore[arg-type]
    assert await anext(stream) == b'data: {"object":"list","data":[]}\n\n'
    # Nothing changes: the same list is not sent again; a comment keeps the line open.
    assert await anext(stream) == SSE_KEEPALIVE
    assert node.now >= snapshots.STREAM_KEEPALIVE_S
    node.current = dataclasses.replace(empty, instances={"x": inst("x", "a")})
    event = await anext(stream)
    assert [i["id"] for i in json.loads(event.removeprefix(b"data: "))["data"]] == ["x"]
    node.draining = True  # the node stops: its watchers go on elsewhere
    with pytest.raises(StopAsyncIteration):
        await anext(stream)

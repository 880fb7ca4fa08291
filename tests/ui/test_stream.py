"""``GET /v1/cluster/stream``'s snapshots and pace, in this process, over a stand-in of
its node: what top reads (nodes, instance view, who waits), the models by the node's
own names, no repeats, keep-alives, the end at a drain."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import msgspec
import pytest

from meshd.api import cluster_stream, snapshots
from meshd.api.sse import SSE_KEEPALIVE
from meshd.node.cluster import ClusterView
from meshd.node.member_views import NotSecured, PendingView
from tests.node.test_cluster_view import card, inst

WAITING = PendingView(id="c776bc40c375c47c", name="<b>laptop</b>", waiting_s=3.0)


class _Node:
    """What the stream reads of its node; a wait for a change lasts its whole timeout
    (none comes), on ``now``."""

    cluster_name = "home"

    def __init__(self, view: ClusterView, pending: list[PendingView] | None) -> None:
        self.now = 0.0
        self.current = view
        self.pending = pending
        self.draining = False

    def view(self) -> ClusterView:
        return self.current

    def instance_load(self) -> dict[str, int]:
        return {}

    def members(self) -> tuple[list[Any], list[PendingView]]:
        if self.pending is None:
            raise NotSecured("open")
        return [], self.pending

    async def changed(self, timeout: float) -> bool:
        await asyncio.sleep(0)
        self.now += timeout
        return False


def _data(event: bytes) -> dict[str, Any]:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event.removeprefix(b"data: "))


def _view(**kw: Any) -> ClusterView:
    base = ClusterView("a", {"a": card("a"), "b": card("b", models=("m", "other"))}, {}, {},
                       {"a": "alive", "b": "alive"}, {"a": 0.0, "b": 0.2})  # fmt: skip
    return dataclasses.replace(base, **kw)


def test_a_snapshot_is_what_top_reads_and_the_models_with_their_holders() -> None:
    node = _Node(_view(instances={"x": inst("x", "a", "b")}), [WAITING])
    snap = json.loads(msgspec.json.encode(cluster_stream.cluster_snapshot(node)))  # type: ignore[arg-type]
    assert snap["cluster"]["self"] == "a" and snap["cluster"]["cluster"] == "home"
    assert [n["name"] for n in snap["cluster"]["nodes"]] == ["n-a", "n-b"]
    assert [i["id"] for i in snap["instances"]["data"]] == ["x"]
    assert [s["node"] for s in snap["instances"]["data"][0]["stages"]] == ["a", "b"]
    assert snap["pending"][0]["name"] == "<b>laptop</b>"
    by_model = {m["model"]: m for m in snap["models"]}
    assert by_model["m"]["nodes"] == ["n-a", "n-b"]
    assert [i["id"] for i in by_model["m"]["instances"]] == ["x"]
    assert by_model["other"]["nodes"] == ["n-b"] and by_model["other"]["instances"] == []
    # A node that is not live holds nothing for the cluster.
    gone = _Node(_view(liveness={"a": "alive", "b": "dead"}), None)
    models = {m.model: m.nodes for m in cluster_stream.cluster_snapshot(gone).models}  # type: ignore[arg-type]
    assert models == {"m": ["n-a"]}


async def test_the_stream_sends_at_once_keeps_alive_while_quiet_and_ends_at_a_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(snapshots, "STREAM_MIN_INTERVAL_S", 0.0)
    node = _Node(_view(), None)  # an open cluster: nobody to approve
    stream = cluster_stream.cluster_snapshots(node, clock=lambda: node.now)  # type: ignore[arg-type]
    first = _data(await anext(stream))
    assert first["object"] == "cluster.snapshot" and first["pending"] is None
    assert first["instances"] == {"object": "list", "data": []}
    # Nothing changes: the same snapshot is not sent again; a comment keeps the line.
    assert await anext(stream) == SSE_KEEPALIVE
    assert node.now >= snapshots.STREAM_KEEPALIVE_S
    node.current = _view(instances={"x": inst("x", "a")})
    assert [i["id"] for i in _data(await anext(stream))["instances"]["data"]] == ["x"]
    node.pending = [WAITING]
    assert _data(await anext(stream))["pending"][0]["id"] == WAITING.id
    node.draining = True  # the node stops: the page goes on with another node
    with pytest.raises(StopAsyncIteration):
        await anext(stream)

"""Waits on the cluster end at the change that decides them, not at a polling tick, and
keep their time limits when nothing changes. One node in this process, real sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from meshd.crdt.views import health_key, instance_key, node_key
from meshd.domain.job import Job
from meshd.node.changes import Changes
from meshd.node.config import NodeConfig
from meshd.node.errors import ModelLoading, RequestFailed
from meshd.node.instances import Instances
from meshd.node.requests import Requests
from meshd.transport import wire
from meshd.transport.dataplane import DataPlane

from .local import Local, local_node
from .test_cluster_view import card, health, inst, runner
from .test_membership import membership

#: Slack for a wait that ends at its own time limit.
PROMPT_S = 0.3


async def settles(fut: asyncio.Future, turns: int = 50) -> bool:
    """Whether ``fut`` completes within ``turns`` rounds of the event loop, no timer
    firing in between (microseconds): a woken wait does, a polling one cannot."""
    for _ in range(turns):
        if fut.done():
            return True
        await asyncio.sleep(0)
    return fut.done()


async def test_changes_wake_waiters_and_listeners_and_time_out_otherwise() -> None:
    changes = Changes()
    heard: list[int] = []
    changes.listen(lambda: heard.append(1))
    t0 = time.monotonic()
    assert await changes.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.05
    waiter = asyncio.ensure_future(changes.wait(5.0))
    await asyncio.sleep(0)
    changes.notify()
    assert await asyncio.wait_for(waiter, 1.0) is True
    assert heard == [1]


def serving_b(n: Local, state: str = "ready", port: int = 1) -> None:
    """Node b: a card, a heartbeat with runner x/0 in ``state``, alive."""
    n.from_peer("b", node_key("b"), card("b"))
    n.from_peer("b", health_key("b"), health(runner("x", 0, state, port=port)))
    n.state.liveness.beat("b", time.monotonic_ns(), time.monotonic())


async def test_waiting_for_a_model_ends_at_the_heartbeat_that_says_it_is_ready(
    tmp_path: Path,
) -> None:
    async with local_node() as n:
        serving_b(n, "loading")
        n.state.write(instance_key("x"), inst("x", "b"))
        instances = Instances(n.state, NodeConfig(), cache_dir=tmp_path, aborted=lambda: None)
        waiting = asyncio.ensure_future(instances.wait_ready("x", "m", wait=30))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        n.from_peer("b", health_key("b"), health(runner("x", 0, "ready", port=7)))
        n.state.changes.notify()  # what the node does for a merged topology change
        assert await settles(waiting)
        assert waiting.result().id == "x"


async def test_a_model_that_does_not_load_in_time_is_model_loading(tmp_path: Path) -> None:
    async with local_node() as n:
        serving_b(n, "loading")
        n.state.write(instance_key("x"), inst("x", "b"))
        instances = Instances(n.state, NodeConfig(), cache_dir=tmp_path, aborted=lambda: None)
        t0 = time.monotonic()
        with pytest.raises(ModelLoading):
            await asyncio.wait_for(instances.wait_ready("x", "m", wait=0.4), 5)
        assert 0.4 <= time.monotonic() - t0 < 0.4 + PROMPT_S


async def _open_request(
    n: Local, cfg: NodeConfig
) -> tuple[DataPlane, AsyncIterator[wire.DataChunk], asyncio.Future[wire.DataChunk]]:
    """A request on instance x (one stage, on b) whose stage never answers."""
    dp = DataPlane(n.ctx, node_id="a", own_addresses=["127.0.0.1"], bind_host="127.0.0.1")
    dp.start()
    requests = Requests(n.state, dp, cfg)
    chunks = requests.generate(inst("x", "b"), Job(prompt="hi"), replay=False)
    return dp, chunks, asyncio.ensure_future(anext(chunks))


async def test_a_request_whose_stage_fails_ends_at_that_change_not_at_the_chunk_timeout() -> None:
    async with local_node() as n:
        serving_b(n, port=9)  # a runner port nothing listens on: the request hangs
        dp, chunks, first = await _open_request(n, NodeConfig())
        try:
            await asyncio.sleep(0.3)
            assert not first.done()
            n.from_peer("b", health_key("b"), health(runner("x", 0, "failed", reason="boom")))
            n.state.changes.notify()
            assert await settles(first)
            with pytest.raises(RequestFailed) as e:
                first.result()
            assert e.value.code == "stage_lost" and "boom" in e.value.message
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            await dp.stop()


@pytest.mark.parametrize("suspect_before", [False, True])
async def test_a_silent_request_on_a_suspect_node_ends_after_the_suspect_silence(
    suspect_before: bool,
) -> None:
    # Node b just goes quiet: it turns suspect during the wait (the liveness tick
    # wakes the request), or was suspect already when the wait began (it wakes itself).
    async with local_node(suspect_after=0.2, dead_after=60) as n:
        serving_b(n, port=9)
        n.tasks.spawn(membership(n).run())
        if suspect_before:
            await asyncio.sleep(0.5)
            assert not n.state.is_alive("b") and n.state.is_live("b")
        cfg = NodeConfig(suspect_silence=0.6)
        dp, chunks, first = await _open_request(n, cfg)
        t0 = time.monotonic()
        try:
            with pytest.raises(RequestFailed) as e:
                await asyncio.wait_for(first, 5)
            assert e.value.code == "stage_lost" and "stopped answering" in e.value.message
            assert 0.6 <= time.monotonic() - t0 < 0.6 + PROMPT_S
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            await dp.stop()


async def test_a_stopping_node_ends_its_open_requests_at_once() -> None:
    async with local_node() as n:
        serving_b(n, port=9)
        dp = DataPlane(n.ctx, node_id="a", own_addresses=["127.0.0.1"], bind_host="127.0.0.1")
        dp.start()
        requests = Requests(n.state, dp, NodeConfig())
        chunks = requests.generate(inst("x", "b"), Job(prompt="hi"))
        first = asyncio.ensure_future(anext(chunks))
        try:
            await asyncio.sleep(0.3)
            assert requests.in_flight() == 1
            requests.abort("test stop")
            assert await settles(first)
            with pytest.raises(RequestFailed) as e:
                first.result()
            assert e.value.code == "node_stopping" and e.value.status == 503
            assert requests.in_flight() == 0
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            await dp.stop()

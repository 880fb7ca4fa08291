"""Reconcile: the runners a node runs follow the plans that name it.

In this process, against the supervisor itself: its settings are the node's; a stage
whose model is not here, or one over the node's cap, fails without a process and the
node keeps saying so after the stage moves; one whose holder this node has not heard of
yet waits a few heartbeats for it before it gives up; a burst of plan changes is one reconcile;
a real runner computes with the threads the free cores it is told of leave it, keeps its
process when only the plan's generation moves, and is replaced when its range does, and
the slice it no longer uses leaves the cache when the cache is over its quota.
"""

from __future__ import annotations

import asyncio
from dataclasses import fields
from pathlib import Path

import msgspec
import pytest

from meshd.crdt.views import Instance
from meshd.engines.threads import GOMP_DEFAULT_SPINCOUNT, default_threads
from meshd.models import DEFAULT_MODEL, ModelNotFoundError, resolve_model
from meshd.models.facts import read_model_facts
from meshd.models.slicing import slice_path
from meshd.node import stage_fetch
from meshd.node.cluster import FETCH_FAILED, MODEL_MISSING, REFUSED, gave_up
from meshd.node.config import NodeConfig
from meshd.node.stage_runners import desired_stages, undesired
from meshd.node.supervisor import Supervisor
from meshd.node.supervisor_settings import SupervisorSettings
from meshd.node.thread_tuner import tune_threads

from .test_cluster_view import inst


def supervisor(tmp_path: Path, resolve=None, slice_cache: int = 1 << 40) -> Supervisor:
    def missing(model: str) -> str:
        raise ModelNotFoundError(model, ["nowhere"])

    settings = SupervisorSettings(
        cache_dir=tmp_path, bind_host="127.0.0.1", n_ctx=512, n_seq_max=2, stop_grace=2.0,
        slice_cache=slice_cache,
    )  # fmt: skip
    return Supervisor("a", settings, resolve_path=resolve or missing, on_status=lambda: None)


async def test_a_stage_whose_model_is_not_here_fails_and_stays_reported_after_it_moves(
    tmp_path: Path,
) -> None:
    sup = supervisor(tmp_path)
    await sup.reconcile({"x": inst("x", "a")})
    (st,) = sup.statuses()
    assert st.state == "failed" and st.reason.startswith(MODEL_MISSING) and gave_up(st)
    assert all(r.proc is None for r in sup.runners.values())  # nothing was started
    # The plan moves the stage to b: this node keeps reporting why it is out of it.
    await sup.reconcile({"x": inst("x", "b", gen=2)})
    assert [s.reason for s in sup.statuses()] == [st.reason]
    # The instance is deleted: nothing left to say.
    await sup.reconcile({})
    assert sup.statuses() == []
    await sup.stop_all()


async def test_a_stage_waits_for_a_holder_it_has_not_heard_of_yet_before_it_gives_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node placed a stage before the holder's card reaches it must not give the
    # stage up at once: placement would move it away from this node for good.
    monkeypatch.setattr(stage_fetch, "HOLDER_WAIT_S", 1.5)
    heard = asyncio.Event()
    asked: list[int] = []

    async def fetch(inst: Instance, i: int, dest: Path, progress: object) -> None:
        asked.append(i)
        raise OSError("the holder went away")  # what a fetch says is the fetch's

    plain = supervisor(tmp_path)  # its model is nowhere here
    settings, missing = plain.settings, plain.resolve_path
    sup = Supervisor("a", settings, resolve_path=missing, on_status=lambda: None, fetch=fetch,
                     fetchable=lambda inst: heard.is_set())  # fmt: skip
    await sup.reconcile({"x": inst("x", "a")})
    assert [s.state for s in sup.statuses()] == ["fetching"]  # waiting, not given up
    asyncio.get_running_loop().call_later(0.5, heard.set)  # the card arrives
    async with asyncio.timeout(10):
        while not asked or sup.statuses()[0].state != "failed":
            await asyncio.sleep(0.05)
    assert asked == [0] and sup.statuses()[0].reason.startswith(FETCH_FAILED)
    await sup.stop_all()
    # No holder within the wait: the stage is given up as before, model missing.
    heard.clear()
    sup = Supervisor("a", settings, resolve_path=missing, on_status=lambda: None, fetch=fetch,
                     fetchable=lambda inst: heard.is_set())  # fmt: skip
    await sup.reconcile({"y": inst("y", "a")})
    async with asyncio.timeout(10):
        while sup.statuses()[0].state != "failed":
            await asyncio.sleep(0.05)
    (st,) = sup.statuses()
    assert st.reason.startswith(MODEL_MISSING) and gave_up(st) and asked == [0]
    await sup.stop_all()


def test_the_settings_are_the_node_configs() -> None:
    cfg = NodeConfig(data_dir=Path("/data"), mesh_host="10.0.0.1", n_ctx=777, max_runners=3,
                     stop_grace=1.5, restart_backoff=0.25, max_tokens=99)  # fmt: skip
    s = SupervisorSettings.from_config(cfg, memory=123)
    assert s.cache_dir == Path("/data/cache") and s.bind_host == "10.0.0.1" and s.memory == 123
    for f in fields(SupervisorSettings):
        if hasattr(cfg, f.name):
            assert getattr(s, f.name) == getattr(cfg, f.name), f.name


def test_this_nodes_stages_in_plan_order_and_those_no_plan_gives_it_any_more() -> None:
    plans = {"x": inst("x", "a", "b"), "y": inst("y", "b", "a", "a")}
    desired = desired_stages(plans, "a")
    assert list(desired) == [("x", 0), ("y", 1), ("y", 2)]
    assert desired[("y", 2)] == (plans["y"], 2)
    assert undesired([("x", 0), ("x", 1), ("z", 0)], desired) == [("x", 1), ("z", 0)]


async def test_a_stage_over_the_nodes_cap_is_refused_once_and_taken_when_room_is_made(
    tmp_path: Path,
) -> None:
    sup = Supervisor(
        "a", SupervisorSettings(cache_dir=tmp_path, bind_host="127.0.0.1", max_runners=0),
        resolve_path=lambda m: str(tmp_path / "never-asked.gguf"), on_status=lambda: None,
    )  # fmt: skip
    await sup.reconcile({"x": inst("x", "a")})
    refused = sup.runners[("x", 0)]
    assert refused.state == "failed" and refused.reason.startswith(REFUSED)
    assert refused.proc is None and gave_up(refused.status())
    await sup.reconcile({"x": inst("x", "a", gen=2)})
    assert sup.runners[("x", 0)] is refused  # said once, not at every reconcile
    # The plan moves the stage away: the refusal is remembered as the reason.
    await sup.reconcile({"x": inst("x", "b", gen=3)})
    assert [s.reason for s in sup.statuses()] == [refused.reason]
    await sup.stop_all()


async def test_a_burst_of_plan_changes_is_one_reconcile(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    reads: list[int] = []

    def plans() -> dict[str, Instance]:
        reads.append(1)
        return {}

    for _ in range(5):
        sup.schedule(plans)
    for _ in range(5):
        await asyncio.sleep(0)
    assert reads == [1]
    sup.schedule(plans)  # a change after it: one more
    for _ in range(5):
        await asyncio.sleep(0)
    assert reads == [1, 1]
    await sup.stop_all()


async def _ready(sup: Supervisor, generation: int, timeout: float = 90) -> None:
    async with asyncio.timeout(timeout):
        while not any(s.state == "ready" and s.generation == generation for s in sup.statuses()):
            if any(s.state == "failed" for s in sup.statuses()):
                pytest.fail(f"runner failed: {sup.statuses()}")
            await asyncio.sleep(0.05)


async def _threads_follow_the_free_cores(sup: Supervisor) -> None:
    """Told that other processes hold the cores, the runner computes with one thread;
    told they are free again, with its whole share, as llama.cpp's context says back."""
    r = sup.runners[("x", 0)]
    most = r.config.n_threads or default_threads()
    if most < 2:
        return  # one core: no thread to take away
    free = [0.5]
    tuning = asyncio.create_task(
        tune_threads(lambda: sup.runners.values(), every=0.01, free=lambda pids: free[0])
    )
    try:
        async with asyncio.timeout(30):
            while r.threads != 1:
                await asyncio.sleep(0.02)
            free[0] = float(most)
            while r.threads != most:
                await asyncio.sleep(0.02)
    finally:
        tuning.cancel()


@pytest.mark.timeout(180)
async def test_a_new_generation_keeps_the_runner_and_a_new_range_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        path = resolve_model(DEFAULT_MODEL).path
    except LookupError:
        pytest.skip("the default model is not installed")
    facts = await asyncio.to_thread(read_model_facts, DEFAULT_MODEL, tmp_path)
    # No room for unused slices: the one a replaced runner used goes at once.
    sup = supervisor(tmp_path, resolve=lambda m: path, slice_cache=0)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)  # the suite's (tests/conftest.py)
    monkeypatch.delenv("MESHD_THREADS", raising=False)  # it would pin the threads

    def plan(gen: int, end: int) -> dict[str, Instance]:
        i = inst("x", "a", gen=gen, model=DEFAULT_MODEL)
        stage = type(i.stages[0])(node="a", start=0, end=end, engine="llama_cpp")
        return {"x": msgspec.structs.replace(i, stages=[stage], facts=facts)}

    n = facts.n_layers
    try:
        await sup.reconcile(plan(1, n))
        await _ready(sup, 1)
        first = sup.runners[("x", 0)].proc
        assert first is not None
        # A whole model alone on the node: its OpenMP threads spin as libgomp's do.
        environ = Path(f"/proc/{first.pid}/environ")
        if environ.exists():
            env = dict(v.split(b"=", 1) for v in environ.read_bytes().split(b"\0") if b"=" in v)
            assert env[b"GOMP_SPINCOUNT"] == str(GOMP_DEFAULT_SPINCOUNT).encode()
        await _threads_follow_the_free_cores(sup)
        await sup.reconcile(plan(2, n))  # a repair elsewhere: same stage, same weights
        await _ready(sup, 2)
        assert sup.runners[("x", 0)].proc is first and first.returncode is None
        await sup.reconcile(plan(3, n - 1))  # another range: another runner
        second = sup.runners[("x", 0)].proc
        assert second is not None and second is not first
        assert first.returncode is not None
        await _ready(sup, 3)
        old = slice_path(tmp_path, facts.sha256, 0, n - 1)
        assert old.is_file()  # in use: kept, quota or not
        await sup.reconcile(plan(4, n - 2))
        await _ready(sup, 4)
        assert not old.is_file()
        assert slice_path(tmp_path, facts.sha256, 0, n - 2).is_file()
    finally:
        await sup.stop_all()
    assert all(r.proc is None or r.proc.returncode is not None for r in sup.runners.values())

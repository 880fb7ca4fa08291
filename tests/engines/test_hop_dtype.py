"""What a hop carries: stage 0 of the default model, cut at layer 15, sends a request's
rows as its instance's narrow type (f16 by default), and as float32 for a request in
the exact mode; a long prompt's rows in chunks, each as soon as it is computed. The
test plays stage 1 over a real ROUTER and reads what arrives."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from meshd.domain.job import Job
from meshd.domain.sampling import Sampling
from meshd.transport import wire

from .runners import ApiSide, RunnerProcess, runner_config

pytestmark = pytest.mark.timeout(180)

BOUNDS = [(0, 15), (15, 30)]
HIDDEN = 576  # the default model's width


@pytest.fixture(scope="module")
def stage0(
    model_path: Path, slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunnerProcess]:
    cfg = runner_config(model_path, slice_dir, bounds=BOUNDS, send_dtype="f16")
    r = RunnerProcess(cfg, tmp_path_factory.mktemp("hop"))
    yield r
    r.stop()


@pytest.fixture
def next_stage() -> Iterator[tuple[zmq.Socket, wire.Addr]]:
    """A ROUTER where stage 1 would be."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, wire.Addr(node="stage1", addresses=["127.0.0.1"], port=port)
    sock.close(linger=0)


def _first_hop(
    api: ApiSide, stage0: RunnerProcess, nxt: tuple[zmq.Socket, wire.Addr], req: str, exact: bool
) -> tuple[wire.Activation, int]:
    sock, addr = nxt
    api.send(stage0, wire.Generate(
        req=req, instance=stage0.cfg.instance, generation=stage0.cfg.generation,
        route=[stage0.addr, addr], reply_to=api.reply_to,
        job=Job(prompt="Once upon a time", exact=exact,
                sampling=Sampling(temperature=0.0, max_tokens=4)),
    ))  # fmt: skip
    while True:  # past the releases of the requests before (the chain's cancels)
        assert sock.poll(60_000), "stage 0 sent nothing on"
        frames = sock.recv_multipart()
        msg = wire.decode_stage(frames[1])
        if not isinstance(msg, wire.Release):
            break
    assert isinstance(msg, wire.Activation) and msg.req == req
    api.cancel(stage0, req)
    stage0.wait_active(0, 10)
    return msg, len(frames[2])


def test_a_hop_carries_f16_rows_and_an_exact_request_float32(
    stage0: RunnerProcess, api: ApiSide, next_stage: tuple[zmq.Socket, wire.Addr]
) -> None:
    fast, size = _first_hop(api, stage0, next_stage, "fast", exact=False)
    assert fast.dtype == "f16" and size == fast.rows * HIDDEN * 2
    assert fast.start is not None and not fast.start.exact
    exact, size = _first_hop(api, stage0, next_stage, "exact", exact=True)
    assert exact.dtype == "f32" and size == exact.rows * HIDDEN * 4
    assert exact.start is not None and exact.start.exact


def test_a_long_prompt_goes_on_in_chunks_each_as_soon_as_it_is_computed(
    stage0: RunnerProcess, api: ApiSide, next_stage: tuple[zmq.Socket, wire.Addr]
) -> None:
    # Exact mode: chunks of the engine's n_batch (455 rows at this runner's context),
    # so a 1,000-token prompt goes as three activations at their absolute positions.
    sock, addr = next_stage
    n = 1000
    api.send(stage0, wire.Generate(
        req="long", instance=stage0.cfg.instance, generation=stage0.cfg.generation,
        route=[stage0.addr, addr], reply_to=api.reply_to,
        job=Job(prompt_tokens=[400 + i % 300 for i in range(n)], exact=True,
                sampling=Sampling(temperature=0.0, max_tokens=1)),
    ))  # fmt: skip
    got: list[tuple[float, wire.Activation]] = []
    while sum(a.rows for _, a in got) < n:
        assert sock.poll(120_000), f"stage 0 sent {len(got)} chunk(s), then nothing"
        frames = sock.recv_multipart()
        msg = wire.decode_stage(frames[1])
        if isinstance(msg, wire.Activation) and msg.req == "long":
            got.append((time.monotonic(), msg))
    api.cancel(stage0, "long")
    stage0.wait_active(0, 10)
    acts = [a for _, a in got]
    starts = [0, *itertools.accumulate(a.rows for a in acts[:-1])]
    assert len(acts) >= 3 and [a.pos for a in acts] == starts
    assert acts[0].start is not None and all(a.start is None for a in acts[1:])
    # The first chunk left before stage 0 computed the others: it arrived at least
    # their compute (each activation says what its step took) before the last one.
    later = sum(a.compute[0] for a in acts[1:])
    assert got[-1][0] - got[0][0] >= 0.5 * later > 0

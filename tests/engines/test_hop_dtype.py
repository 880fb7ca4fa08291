"""What a hop carries: stage 0 of the default model, cut at layer 15, sends a request's
rows as its instance's narrow type (f16 by default), and as float32 for a request in
the exact mode. The test plays stage 1 over a real ROUTER and reads what arrives."""

from __future__ import annotations

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

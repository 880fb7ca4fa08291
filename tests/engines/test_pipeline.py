"""Many requests on a split: the stages work at once (micro-batches in flight), and every
stream's greedy tokens in the exact mode are its own alone.

Two real runners hold the halves of the default model over real ZeroMQ, with a q8_0 KV
cache: flash attention, whose CPU kernel skips masked cells one by one, so a request's
sums do not depend on where its cells sit in the cache it shares with the others (plain
attention, the CPU's f16 and the exact instance's f32 default, sums a masked matmul
whose rounding does: a near-tie flips on this model, with or without micro-batches;
see tests/engines/test_llama_stage.py's ``two_stages``). Each reports
the seconds it has spent stepping (``Load.busy_s``); while the stages step one batch in
turn (stage 1 idle while stage 0 runs it, then the other way round), the wall time of a
run is at least the sum of both stages' step time. Stepped in micro-batches, the sum
passes the wall time by about the shorter stage's share."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.domain.sampling import Sampling

from .runners import ApiSide, RunnerProcess, runner_config, tokens_of

pytestmark = pytest.mark.timeout(300)

HALVES = [(0, 15), (15, 30)]
N_TOKENS = 24
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours:",
]


@pytest.fixture(scope="module")
def split(
    model_path: Path, slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunnerProcess]]:
    logs = tmp_path_factory.mktemp("pipeline")
    route: list[RunnerProcess] = []
    try:
        for i in range(len(HALVES)):
            cfg = runner_config(
                model_path, slice_dir, stage=i, bounds=HALVES, n_seq_max=4, kv_cache="q8_0"
            )
            route.append(RunnerProcess(cfg, logs))
        yield route
    finally:
        for r in route:
            r.stop()


def _load(route: list[RunnerProcess], field: str) -> list[float]:
    """Each runner's ``field`` of its last load report (once every request is freed)."""
    for r in route:
        r.wait_active(0, 30)
    return [[e for e in r.events if e["event"] == "load"][-1][field] for r in route]


def _job(prompt: str) -> dict[str, object]:
    sampling = Sampling(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    return {"prompt": prompt, "exact": True, "sampling": sampling}


def test_stages_step_at_once_and_each_stream_keeps_its_tokens(
    split: list[RunnerProcess], api: ApiSide
) -> None:
    alone = [tokens_of(api.answer(split, f"alone-{i}", **_job(p))) for i, p in enumerate(PROMPTS)]
    assert all(len(t) == N_TOKENS for t in alone)
    before = _load(split, "busy_s")

    t0 = time.perf_counter()
    # Stage 0 stopped, so it reads the four requests in one go, as on a quiet machine
    # (else a loaded test process may send them far enough apart that they arrive in
    # groups of their own: the overlap this test asks for, by chance).
    os.kill(split[0].proc.pid, signal.SIGSTOP)
    try:
        for i, p in enumerate(PROMPTS):
            api.generate(split, f"many-{i}", **_job(p))
        time.sleep(0.5)  # the frames' way to stage 0's socket: only the chance above
    finally:
        os.kill(split[0].proc.pid, signal.SIGCONT)
    together = [tokens_of(api.result(f"many-{i}")) for i in range(len(PROMPTS))]
    wall = time.perf_counter() - t0
    busy = [b - a for a, b in zip(before, _load(split, "busy_s"), strict=True)]

    assert together == alone
    # In turn, sum(busy) <= wall; in flight together, the stages overlap by a good
    # part of the shorter one's time (ideally all of it).
    overlap = sum(busy) - wall
    assert overlap > 0.25 * min(busy), (busy, wall)
    # What makes it so: stage 0 stepped the four in two micro-batches, never all at
    # once (today's stage 1 may also split a batch by chance, reading its rows early).
    assert _load(split, "widest")[0] == 2

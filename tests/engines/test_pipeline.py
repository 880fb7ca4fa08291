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


def _busy(route: list[RunnerProcess]) -> list[float]:
    """Each runner's step seconds as it last reported (once every request is freed)."""
    for r in route:
        r.wait_active(0, 30)
    return [[e for e in r.events if e["event"] == "load"][-1]["busy_s"] for r in route]


def _job(prompt: str) -> dict[str, object]:
    sampling = Sampling(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    return {"prompt": prompt, "exact": True, "sampling": sampling}


def test_stages_step_at_once_and_each_stream_keeps_its_tokens(
    split: list[RunnerProcess], api: ApiSide
) -> None:
    alone = [tokens_of(api.answer(split, f"alone-{i}", **_job(p))) for i, p in enumerate(PROMPTS)]
    assert all(len(t) == N_TOKENS for t in alone)
    before = _busy(split)

    t0 = time.perf_counter()
    for i, p in enumerate(PROMPTS):
        api.generate(split, f"many-{i}", **_job(p))
    together = [tokens_of(api.result(f"many-{i}")) for i in range(len(PROMPTS))]
    wall = time.perf_counter() - t0
    busy = [b - a for a, b in zip(before, _busy(split), strict=True)]

    assert together == alone
    # In turn, sum(busy) <= wall; in flight together, the stages overlap by a good
    # part of the shorter one's time (ideally all of it).
    overlap = sum(busy) - wall
    assert overlap > 0.25 * min(busy), (busy, wall)

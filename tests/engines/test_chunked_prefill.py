"""Chunked prefill is exact: in the exact mode stage 0 cuts a long prompt (longer than
the engine's ``n_batch``) at the engine's own call boundaries, each chunk goes on as
soon as it is computed, and the greedy tokens over 2 and 3 stages are the whole
model's, computed in one piece in process, on llama.cpp and on MLX stages. Real
runner processes over real ZeroMQ, the 4-layer synthetic model (F32)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshd.domain.sampling import Sampling
from meshd.engines.runner.chunks import MIN_CHUNK_ROWS, chunk_rows, split
from meshd.engines.runner.state import Work
from tests.engines.chains import greedy
from tests.synthetic import N_LAYERS, write_model

from .runners import ApiSide, RunnerProcess, runner_config, tokens_of

pytestmark = pytest.mark.timeout(600)  # MLX runners import mlx_lm (and transformers)

N_CTX = 2048
#: Over two of the engines' 512-row calls: three chunks.
PROMPT = [int(t) for t in np.random.default_rng(3).integers(300, 3000, 1200)]
N = 8
CUTS = {"two": [(0, 2), (2, N_LAYERS)], "three": [(0, 1), (1, 3), (3, N_LAYERS)]}


def test_chunks_follow_the_engines_calls_when_exact_and_the_pace_otherwise() -> None:
    assert chunk_rows(512, 0.01, exact=True) == 512  # the engine's own boundaries
    assert chunk_rows(512, 0.0, exact=False) == 512  # nothing measured yet
    assert chunk_rows(512, 0.001, exact=False) == 250  # ~0.25 s of compute
    assert chunk_rows(512, 0.1, exact=False) == MIN_CHUNK_ROWS
    assert chunk_rows(32, 0.1, exact=False) == 32  # never past the engine's calls
    assert chunk_rows(512, 0.01, exact=True, fixed=0) == 0  # the knob: unchunked
    w = Work("r", 7, tokens=np.arange(1100, dtype=np.int32), start=None, epoch=2)
    parts = split(w, 512)
    assert [(p.pos, p.rows, p.epoch) for p in parts] == [(7, 512, 2), (519, 512, 2), (1031, 76, 2)]
    assert split(w, 0) == [w] and split(w, 1100) == [w]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return write_model(
        tmp_path_factory.mktemp("chunked") / "synth.gguf", model_path, "llama", context=N_CTX
    )


@contextlib.contextmanager
def _split(
    path: Path, slice_dir: Path, log_dir: Path, bounds: list[tuple[int, int]], engine: str
) -> Iterator[list[RunnerProcess]]:
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    opts = {"exact": True, "sha256": sha, "n_layers": N_LAYERS, "n_ctx": N_CTX,
            "n_seq_max": 2, "engine": engine}  # fmt: skip
    route: list[RunnerProcess] = []
    try:
        for i in range(len(bounds)):
            cfg = runner_config(path, slice_dir, stage=i, bounds=bounds, **opts)
            route.append(RunnerProcess(cfg, log_dir))
        yield route
    finally:
        for r in route:
            r.stop()


def _whole(path: Path, engine: str) -> list[int]:
    """The reference: the whole model in process, the prompt in one forward call."""
    if engine == "mlx":
        from meshd.engines.mlx_stage import MlxStage

        stage = MlxStage(path, start=0, end=N_LAYERS, first=True, last=True, n_ctx=N_CTX,
                         n_seq_max=1, exact=True)  # fmt: skip
        return greedy([stage], PROMPT, N)[0]
    from meshd.engines.llama_stage import LlamaStage

    with LlamaStage(path, first=True, last=True, n_ctx=N_CTX, n_seq_max=1, exact=True) as s:
        assert s.n_batch < len(PROMPT)
        return greedy([s], PROMPT, N)[0]


@pytest.mark.parametrize("engine", ["llama_cpp", "mlx"])
def test_a_long_prompt_over_two_and_three_stages_gives_the_whole_models_tokens(
    model: Path, slice_dir: Path, tmp_path: Path, api: ApiSide, engine: str
) -> None:
    if engine == "mlx":
        pytest.importorskip("mlx.core")
    want = _whole(model, engine)
    s = Sampling(temperature=0.0, max_tokens=N, ignore_eos=True)
    for name, bounds in CUTS.items():
        with _split(model, slice_dir, tmp_path, bounds, engine) as route:
            got = api.answer(route, f"{engine}-{name}", prompt_tokens=PROMPT, sampling=s,
                             exact=True)  # fmt: skip
            assert tokens_of(got) == want, name

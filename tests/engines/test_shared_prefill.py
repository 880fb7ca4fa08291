"""Choices of one prompt prefill it once: a stage shares the KV and the output of an
identical pos-0 input (``Stage.share``), on llama.cpp and MLX, across a real 2-stage
pipeline of runner processes; new requests that arrive together prefill in one engine
call, with the bits of prefilling them one at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshd.domain.sampling import Sampling
from meshd.engines.llama_stage import LlamaStage
from meshd.engines.runner.step import group_size
from meshd.engines.stage import StageInput, StageInputError

from .runners import ApiSide, RunnerProcess, runner_config, tokens_of

pytestmark = pytest.mark.timeout(300)

PROMPT = "The three best things about autumn are"


def _stage(engine: str, model_path: Path):
    if engine == "mlx":
        pytest.importorskip("mlx.core")
        from meshd.engines.mlx_stage import MlxStage

        return MlxStage(model_path, start=0, end=30, first=True, last=True, n_ctx=128,
                        n_seq_max=3)  # fmt: skip
    return LlamaStage(model_path, first=True, last=True, n_ctx=128, n_seq_max=3)


@pytest.mark.parametrize("engine", ["llama", "mlx"])
def test_a_shared_prefill_decodes_as_its_own_would(model_path: Path, engine: str) -> None:
    with _stage(engine, model_path) as s:
        toks = np.asarray(s.tokenize(PROMPT, add_special=True, parse_special=False), np.int32)
        n = len(toks)
        s.forward([StageInput(seq=0, pos=0, tokens=toks)])
        s.forward([StageInput(seq=0, pos=n, tokens=np.array([42], np.int32))])  # it moves on
        s.share(0, 1, n)
        assert s.n_past(1) == n
        s.forward([StageInput(seq=2, pos=0, tokens=toks)])  # the same prompt, run again
        nxt = np.array([1234], np.int32)
        shared = s.forward([StageInput(seq=1, pos=n, tokens=nxt)])[0]
        own = s.forward([StageInput(seq=2, pos=n, tokens=nxt)])[0]
        np.testing.assert_allclose(shared, own, atol=1e-3)
        with pytest.raises(StageInputError):
            s.share(0, 1, n)  # seq 1 is not empty
        s.free(0)
        assert s.n_past(1) == n + 1  # the share outlives its source


@pytest.fixture(scope="module")
def pipeline(
    model_path: Path, slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunnerProcess]]:
    """Two runners, 15 layers each, four KV slots."""
    log_dir = tmp_path_factory.mktemp("shared")
    bounds = [(0, 15), (15, 30)]
    runners = [
        RunnerProcess(
            runner_config(model_path, slice_dir, stage=i, bounds=bounds, n_seq_max=4), log_dir
        )
        for i in range(2)
    ]
    yield runners
    for r in runners:
        r.stop()


def test_choices_of_one_prompt_run_its_prefill_once_on_every_stage(
    pipeline: list[RunnerProcess], api: ApiSide
) -> None:
    def sampling(seed: int) -> Sampling:
        return Sampling(temperature=0.9, seed=seed, max_tokens=12, ignore_eos=True)

    # Exact, every request: none starts from a prefix another left (a reused prefix is
    # no shared prefill, and moves the low bits the seeds draw from), none drafts.
    # Alone first: what each seed draws with nothing shared.
    alone = {}
    for seed in (1, 2, 3):
        api.generate(pipeline, f"alone-{seed}", prompt=PROMPT, sampling=sampling(seed), exact=True)
        alone[seed] = tokens_of(api.result(f"alone-{seed}"))
    # Three choices at once, and a fourth while they are live.
    for seed in (1, 2, 3):
        api.generate(pipeline, f"n-{seed}", prompt=PROMPT, sampling=sampling(seed), exact=True)
    api.wait("n-1", lambda c: bool(c.tokens), 60)
    api.generate(pipeline, "late", prompt=PROMPT, sampling=sampling(1), exact=True)
    firsts = {}
    for req in ("n-1", "n-2", "n-3", "late"):
        chunks = api.result(req)
        assert not any(c.error for c in chunks), chunks
        first = next(c for c in chunks if c.tokens)
        firsts[req] = first.compute
        got = tokens_of(chunks)
        seed = 1 if req == "late" else int(req[-1])
        # The first token comes from the shared logits themselves: exactly the same.
        assert got[0] == alone[seed][0], req
        assert len(got) == 12
    # On each stage at most one of the four ran the prefill (none, when a request of
    # the same prompt still held it there); the others took it.
    for stage in (0, 1):
        ran = [req for req, c in firsts.items() if c[stage] > 0]
        assert len(ran) <= 1, (stage, firsts)


def test_new_requests_that_arrive_together_prefill_in_one_call(
    pipeline: list[RunnerProcess], api: ApiSide
) -> None:
    prompts = [f"Request {i}: name three {w} and say why." for i, w in
               enumerate(["rivers", "colours", "tools"])]  # fmt: skip
    greedy = Sampling(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = [
        tokens_of(api.answer(pipeline, f"alone-{i}", prompt=p, sampling=greedy, exact=True))
        for i, p in enumerate(prompts)
    ]
    stage0 = pipeline[0]
    before = stage0.load()
    # Stage 0 stopped while they come (a runner busy or not yet scheduled): it finds
    # all three waiting when it runs again, as when they arrive within one step. (On
    # a starved machine its heartbeats may have dropped the link: then this side
    # holds all three until the redial's handshake, and they go in one write.)
    with stage0.paused():
        sent = sum(
            api.generate(pipeline, f"together-{i}", prompt=p, sampling=greedy, exact=True)
            for i, p in enumerate(prompts)
        )
        stage0.wait_unread(sent, 10)
    together = [tokens_of(api.result(f"together-{i}")) for i in range(len(prompts))]
    stage0.wait_active(0, 30)
    after = stage0.load()
    # The three prompts prefilled together, in as few calls as stage 0's micro-batches
    # allow (a split of 2 stages steps its requests in 2 groups: 2 and 1), and each
    # got its answer.
    group = group_size(len(prompts), len(pipeline)) or len(prompts)
    calls = -(-len(prompts) // group)
    assert after["prefill_calls"] - before["prefill_calls"] == calls == 2, (before, after)
    assert after["prefill_steps"] - before["prefill_steps"] == 3, (before, after)
    assert [len(t) for t in together] == [len(t) for t in alone] == [6, 6, 6]
    # Their tokens need not be each one's alone, even exact: a request beside others
    # holds other cells of the shared KV buffer, and where its cells lie moves its
    # sums (below: batching itself moves nothing).


def test_a_batched_prefill_gives_each_prompt_the_bits_of_one_at_a_time(model_path: Path) -> None:
    texts = [f"Request {i}: name three {w} and say why." for i, w in
             enumerate(["rivers", "colours", "tools"])]  # fmt: skip
    with LlamaStage(model_path, first=True, last=True, n_ctx=256, n_seq_max=3,
                    exact=True) as s:  # fmt: skip
        prompts = [np.asarray(s.tokenize(t, add_special=True, parse_special=False), np.int32)
                   for t in texts]  # fmt: skip
        # One at a time, each beside the ones before (as they would arrive apart)...
        apart = [s.forward([StageInput(seq=i, pos=0, tokens=p)])[0] for i, p in enumerate(prompts)]
        for i in range(3):
            s.free(i)
        # ...and all in one call: the same cells, so the same bits, in the exact mode.
        together = s.forward([StageInput(seq=i, pos=0, tokens=p) for i, p in enumerate(prompts)])
    for a, b in zip(apart, together, strict=True):
        np.testing.assert_array_equal(a, b)

"""The prefix cache: a finished request's KV stays on its sequence, and a later request
whose tokens begin the same way starts from it on every stage (real llama.cpp and MLX
stages; real runner processes over real ZeroMQ for the pipeline)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from meshd.domain.exact import EXACT, FastPaths, fast_paths, settled
from meshd.domain.job import Job
from meshd.domain.sampling import Sampling
from meshd.engines.llama_stage import LlamaStage
from meshd.engines.runner import common_prefix
from meshd.engines.runner.admission import reuses_prefix, speculates
from meshd.engines.stage import StageInput, StageInputError
from meshd.transport import wire
from tests.synthetic import N_LAYERS, write_model

from .runners import ApiSide, RunnerProcess, runner_config, tokens_of

pytestmark = pytest.mark.timeout(300)

#: Long enough that a reused start is most of the prompt.
STORY = (
    "Once upon a time, in a village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. Each morning he walked to the "
    "square, wound the tower clock, and listened to its bell ring across the rooftops. "
)
GREEDY = Sampling(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([7], [8]) == 0


SEEDED = Sampling(temperature=0.8, seed=3)


def test_every_request_takes_the_fast_paths_unless_exact(tmp_path: Path) -> None:
    def reuses(job: Job, resume: list[int] | None = None) -> bool:
        addr = wire.Addr("n", ["127.0.0.1"], 1)
        g = wire.Generate(req="r", instance="i", generation=1, route=[addr], reply_to=addr,
                          job=job, resume_tokens=resume or [])  # fmt: skip
        return reuses_prefix(g)

    one = runner_config(tmp_path, tmp_path)
    split = runner_config(tmp_path, tmp_path, bounds=[(0, 15), (15, 30)])
    for s in (GREEDY, SEEDED, Sampling(temperature=0.8)):
        job = Job(prompt="x", sampling=s)
        assert fast_paths(job) == FastPaths()
        assert reuses(job) and speculates(job, split) and not speculates(job, one)
        exact = settled(job, instance_exact=True)
        assert fast_paths(exact) is EXACT
        asked = msgspec.structs.replace(exact, cache_prompt=True, speculate=True)
        assert not reuses(asked) and not speculates(asked, split)
    # Asked: a cold run, no drafts; a replay never reuses; a request's own exact
    # wins over its instance's.
    assert not reuses(Job(prompt="x", cache_prompt=False))
    assert not speculates(Job(prompt="x", speculate=False), split)
    assert not reuses(Job(prompt="x"), resume=[1])
    mine = settled(Job(prompt="x", exact=False), instance_exact=True)
    assert reuses(mine) and speculates(mine, split)


@pytest.mark.parametrize("engine", ["llama", "mlx"])
def test_a_truncated_sequence_continues_as_a_fresh_one(
    model_path: Path, synth: tuple[Path, str], engine: str
) -> None:
    if engine == "mlx":
        pytest.importorskip("mlx.core")
        from meshd.engines.mlx_stage import MlxStage

        # The synthetic model too: truncation is under test, and MLX's CPU backend
        # takes ~0.1 s a row of the default model.
        stage = MlxStage(synth[0], start=0, end=N_LAYERS, first=True, last=True, n_ctx=256,
                         n_seq_max=2)  # fmt: skip
    else:
        # F32 weights: the quantized default model's K/V for the same positions move
        # with the size of the batch that computed them (by up to ~0.6 in a logit on an
        # AVX2 CPU), which says nothing of truncation.
        stage = LlamaStage(synth[0], first=True, last=True, n_ctx=256, n_seq_max=2, exact=True)
    with stage as s:
        toks = np.asarray(s.tokenize(STORY, add_special=True, parse_special=False), np.int32)
        n = len(toks)
        s.forward([StageInput(seq=0, pos=0, tokens=toks)])
        s.truncate(0, n - 5)
        assert s.n_past(0) == n - 5
        again = s.forward([StageInput(seq=0, pos=n - 5, tokens=toks[n - 5 :])])[0]
        fresh = s.forward([StageInput(seq=1, pos=0, tokens=toks)])[0]
        np.testing.assert_allclose(again, fresh, atol=1e-3)
        with pytest.raises(StageInputError):
            s.truncate(0, n + 1)  # it holds fewer


@pytest.fixture(scope="module")
def synth(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A small F32 model: a prefill split anywhere gives the same logits to ~1e-6
    (the quantized default model's batched kernels differ by ~0.5 from one row's)."""
    path = write_model(tmp_path_factory.mktemp("synth") / "synth.gguf", model_path, "llama")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _pipeline(
    model: tuple[Path, str], cache: Path, log_dir: Path, seqs: tuple[int, int], **kw: object
) -> list[RunnerProcess]:
    half = N_LAYERS // 2
    bounds = [(0, half), (half, N_LAYERS)]
    return [
        RunnerProcess(
            runner_config(
                model[0],
                cache,
                stage=i,
                bounds=bounds,
                n_seq_max=n,
                exact=True,
                sha256=model[1],
                n_layers=N_LAYERS,
                n_ctx=512,
                **kw,
            ),
            log_dir,
        )
        for i, n in enumerate(seqs)
    ]


@pytest.fixture(scope="module")
def two_slots(
    synth: tuple[Path, str], slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunnerProcess]]:
    """Two stages, two KV sequences each: kept prefixes are evicted and taken over."""
    runners = _pipeline(synth, slice_dir, tmp_path_factory.mktemp("prefix"), (2, 2))
    yield runners
    for r in runners:
        r.stop()


def _run(api: ApiSide, route: list[RunnerProcess], req: str, **kw: object) -> list[wire.DataChunk]:
    # Unasked, greedy requests use the cache too (see the default's test). A split
    # drafts unasked as well: not here, where the cache alone is under test.
    api.generate(route, req, **{"sampling": GREEDY, "speculate": False, **kw})
    chunks = api.result(req)
    assert not any(c.error for c in chunks), chunks
    # Its release reaches stage 0 a moment after the answer reaches us (from the last
    # stage, both): only then is its KV kept there for the next request.
    route[0].wait_active(0, 10)
    return chunks


def _tokens(route: list[RunnerProcess], text: str, bos: bool) -> list[int]:
    """``text`` in the model's vocabulary, as stage 0 tokenizes a plain prompt."""
    from meshd.engines.llama_stage import LlamaVocab

    vocab = LlamaVocab.load(Path(route[0].cfg.model_path))
    try:
        return vocab.tokenize(text, add_special=bos, parse_special=False)
    finally:
        vocab.close()


def test_turn_two_starts_from_turn_one_and_answers_as_if_computed(
    two_slots: list[RunnerProcess], api: ApiSide
) -> None:
    first = _run(api, two_slots, "t1", prompt=STORY)
    assert first[0].n_cached == 0 and first[-1].usage.cached_tokens == 0
    prompt = _tokens(two_slots, STORY, bos=True)
    assert len(prompt) == first[0].n_prompt
    answer = tokens_of(first)

    # Turn 2: the whole of turn 1 (its prompt and its answer) and more.
    turn2 = [*prompt, *answer, *_tokens(two_slots, " And the clock", bos=False)]
    cached = _run(api, two_slots, "t2", prompt_tokens=turn2)
    fresh = _run(api, two_slots, "t2-fresh", prompt_tokens=turn2, cache_prompt=False)
    # All turn 1 computed is reused: its prompt and its answer but the last token
    # (sampled, never fed back).
    reused = len(prompt) + len(answer) - 1
    assert cached[0].n_cached == reused
    assert cached[-1].usage == wire.Usage(len(turn2), 8, reused)
    assert fresh[0].n_cached == 0 and fresh[-1].usage.cached_tokens == 0
    # Exact mode: the same greedy answer as the prompt computed whole.
    assert tokens_of(cached) == tokens_of(fresh)


def test_unasked_every_request_uses_the_cache_and_an_exact_one_none(
    two_slots: list[RunnerProcess], api: ApiSide
) -> None:
    prompt = STORY + " The end."

    def n_cached(req: str, sampling: Sampling, **kw: object) -> int:
        # The base again first: each request finds STORY kept, whatever the one
        # before it left.
        _run(api, two_slots, f"base-{req}", prompt=STORY)
        api.generate(two_slots, req, prompt=prompt, sampling=sampling, **kw)
        chunks = api.result(req)
        assert not any(c.error for c in chunks), chunks
        two_slots[0].wait_active(0, 10)
        return chunks[0].n_cached

    seeded = Sampling(temperature=0.8, seed=3, max_tokens=4)
    assert n_cached("sampled", Sampling(temperature=0.8, max_tokens=4)) > 0
    # As llama.cpp's server: greedy and seeded requests too (a near-tie may flip).
    assert n_cached("greedy", GREEDY) > 0
    assert n_cached("seeded", seeded) > 0
    # A cold run when asked, and in the exact mode, whatever cache_prompt says then.
    assert n_cached("cold", GREEDY, cache_prompt=False) == 0
    assert n_cached("exact", seeded, exact=True) == 0
    assert n_cached("exact-asked", GREEDY, exact=True, cache_prompt=True) == 0


def test_kept_prefixes_give_way_and_the_last_one_is_taken_over(
    two_slots: list[RunnerProcess], api: ApiSide
) -> None:
    # Three prompts through two sequences: the third evicts the oldest kept one.
    runs = {
        text: _run(api, two_slots, f"fill-{i}", prompt=text * 3)
        for i, text in enumerate(["A recipe for bread: ", "The rules of chess: ", STORY])
    }
    # The same prompt again starts from its kept KV, three times: the first copies
    # it into the free sequence, the next ones find none free and either evict the
    # other kept one or take the source itself over.
    for i in range(3):
        again = _run(api, two_slots, f"again-{i}", prompt=STORY * 3)
        assert again[0].n_cached == again[0].n_prompt - 1
        assert tokens_of(again) == tokens_of(runs[STORY])
    # What was evicted is computed again, and still right.
    bread = _run(api, two_slots, "bread", prompt="A recipe for bread: " * 3)
    assert tokens_of(bread) == tokens_of(runs["A recipe for bread: "])
    assert all(r.alive() for r in two_slots)


def test_a_stage_without_the_prefix_ends_the_request_and_stage_0_forgets_it(
    synth: tuple[Path, str], slice_dir: Path, tmp_path: Path, api: ApiSide
) -> None:
    # Stage 1 holds fewer sequences than stage 0: it must drop a prefix stage 0 keeps.
    route = _pipeline(synth, slice_dir, tmp_path, (3, 1))
    try:
        _run(api, route, "a", prompt=STORY)
        _run(api, route, "b", prompt="An unrelated prompt about the weather in spring.")
        api.generate(route, "c", prompt=STORY + "More.", sampling=GREEDY, cache_prompt=True)
        chunks = api.result("c")
        assert chunks[-1].error is not None and chunks[-1].error.code == "prefix_miss"
        # Stage 1 told stage 0 too (the release frees c there): a's prefix is forgotten.
        route[0].wait_active(0, 10)
        d = _run(api, route, "d", prompt=STORY + "More.")
        assert d[0].n_cached == 0 and tokens_of(d)
        # d's own KV is the one stage 1 kept: the same prompt again starts from it.
        e = _run(api, route, "e", prompt=STORY + "More.")
        assert e[0].n_cached == e[0].n_prompt - 1 and tokens_of(e) == tokens_of(d)
    finally:
        for r in route:
            r.stop()


def test_a_prefix_unused_for_more_rows_than_it_is_worth_is_dropped(
    synth: tuple[Path, str], slice_dir: Path, tmp_path: Path, api: ApiSide
) -> None:
    # Room for every request here: only age drops a kept prefix. Stage 0 drops one
    # after 100 rows computed beside it, stage 1 after 150.
    route = _pipeline(synth, slice_dir, tmp_path, (4, 4), kept_prefix_rows=100)
    try:
        first = _run(api, route, "a", prompt=STORY)
        _run(api, route, "short", prompt="A short one.")  # ~15 rows
        again = _run(api, route, "a-again", prompt=STORY)
        assert again[0].n_cached == again[0].n_prompt - 1
        long = _run(api, route, "long", prompt="The rules of chess: " * 40)
        assert long[0].n_prompt > 160  # more rows than either stage keeps a prefix for
        late = _run(api, route, "a-late", prompt=STORY)
        # Gone on both stages: computed again (a stage that had dropped it alone
        # would have ended the request with prefix_miss), and still right.
        assert late[0].n_cached == 0
        assert tokens_of(late) == tokens_of(first)
        # The long prompt was used last: it is still kept.
        assert _run(api, route, "long-again", prompt="The rules of chess: " * 40)[0].n_cached
    finally:
        for r in route:
            r.stop()

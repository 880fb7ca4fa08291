"""Speculative decoding through the pipeline: stage 0 drafts by prompt lookup, every
stage runs the drafted rows in one pass, the last stage keeps what the model agrees
with, and the rejected rows' KV is dropped on every stage. Real runner processes over
real ZeroMQ, a small F32 model in exact mode (where a batch of rows and one row a step
agree to ~1e-6, so greedy output must be the same token for token)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from meshd.domain.sampling import Sampling
from meshd.engines.drafting import RETRY_STEPS, DraftBudget, InFlight, Step, prompt_lookup
from meshd.transport import wire
from tests.synthetic import N_LAYERS, write_model

from .runners import ApiSide, RunnerProcess, runner_config, text_of, tokens_of

pytestmark = pytest.mark.timeout(300)

#: Repeats itself: what an answer that quotes its input looks like to a lookup.
PROMPT = "def area(w, h):\n    return w * h\n\n" * 6


def test_prompt_lookup_proposes_what_followed_the_last_ngram() -> None:
    assert prompt_lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]
    # The most recent occurrence wins.
    assert prompt_lookup([7, 8, 1, 7, 8, 2, 7, 8], 2) == [2, 7]
    assert prompt_lookup([1, 2, 3, 4], 4) == []  # nothing repeats
    assert prompt_lookup([1, 2, 1, 2], 0) == []
    # A match too recent for k tokens after it goes on from its own draft: a loop.
    assert prompt_lookup([5, 1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]


def test_stage_0_answers_chained_steps_in_order() -> None:
    f = InFlight()
    f.sent(Step(10, 5, chained=True))  # rows 10-14, its draft's last token fed at 15
    f.sent(Step(15, 5, chained=True))
    f.successor = (7, 20)
    assert f.confirm(16) is None and len(f) == 2  # not the oldest's end: no change
    assert f.confirm(15) == Step(10, 5, True) and len(f) == 1
    # A restart names the oldest step left and forgets the rest, the promise too.
    assert f.restart() == Step(15, 5, True)
    assert len(f) == 0 and f.successor is None and f.restart() is None
    f.sent(Step(30, 2))  # not chained: a token after it restarts, never confirms
    assert f.confirm(32) is None and f.confirm(33) is None


def test_the_budget_follows_acceptance_and_measured_time() -> None:
    b = DraftBudget(k_max=4)
    assert not b.on  # no plain step timed yet: nothing to beat
    for _ in range(3):
        b.plain(0.010)
    assert b.on and b.k == 4
    b.record(4, 1, 0.012)
    assert b.k == 2
    b.record(2, 2, 0.012)
    assert b.k == 3
    for _ in range(6):
        b.record(3, 3, 0.012)  # 4 tokens in 12 ms: 3 ms a token, against 10
    assert b.on
    slow = DraftBudget(k_max=4)
    for _ in range(3):
        slow.plain(0.010)
    for _ in range(6):
        slow.record(4, 0, 0.015)  # one token in 15 ms: worse than without
    assert not slow.on
    wrong = DraftBudget(k_max=4)
    for _ in range(3):
        wrong.plain(0.010)
    for _ in range(6):
        wrong.record(4, 0, 0.001)  # fast, but drafts that never hold
    assert not wrong.on
    assert not DraftBudget(k_max=0).on
    # One draft thrown away whole, in a run of good ones, does not end the run: the
    # totals decide (5 ms a token with it, against 10 without drafts).
    spike = DraftBudget(k_max=4)
    for _ in range(3):
        spike.plain(0.010)
    for _ in range(5):
        spike.record(4, 4, 0.015)
    spike.record(4, 0, 0.040)
    assert spike.on and spike.spec_s == pytest.approx(0.115 / 26)
    # A chained step drafts one more than k (the next step's first token): held whole
    # it gives its k + 1 tokens and no other; cut short, k stays within k_max.
    chained = DraftBudget(k_max=4)
    for _ in range(3):
        chained.plain(0.010)
    chained.record(5, 5, 0.010, bonus=False)
    assert chained.k == 4 and chained.spec_s == pytest.approx(0.002)
    chained.record(5, 4, 0.010)
    assert chained.k == 4
    # A request that stopped drafting tries again after RETRY_STEPS plain steps.
    for _ in range(RETRY_STEPS - 1):
        slow.plain(0.010)
    assert not slow.on
    slow.plain(0.010)
    assert slow.on and slow.k == 4 and slow.spec_s == 0.0


@contextlib.contextmanager
def _split(
    path: Path, slice_dir: Path, log_dir: Path, bounds: list[tuple[int, int]], **kw: object
) -> Iterator[list[RunnerProcess]]:
    """Runner processes for ``path`` cut at ``bounds`` (exact mode unless ``kw`` says)."""
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    opts = {"exact": True, "sha256": sha, "n_layers": N_LAYERS, "n_ctx": 512, **kw}
    route = [
        RunnerProcess(runner_config(path, slice_dir, stage=i, bounds=bounds, **opts), log_dir)
        for i in range(len(bounds))
    ]
    try:
        yield route
    finally:
        for r in route:
            r.stop()


def _chains_to_the_plain_output(api: ApiSide, route: list[RunnerProcess], name: str) -> None:
    """Greedy 60 tokens with speculation are those of an exact run (none), and steps
    went chained."""
    s = Sampling(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = _run(api, route, f"{name}-plain", sampling=s, exact=True)
    spec = _run(api, route, f"{name}-spec", sampling=s, speculate=True)
    assert tokens_of(spec) == tokens_of(plain)
    u = spec[-1].usage
    assert u.accepted_tokens > 0 and u.chained_steps > 0, u


HALVES = [(0, N_LAYERS // 2), (N_LAYERS // 2, N_LAYERS)]


@pytest.fixture(scope="module")
def pipeline(
    model_path: Path, slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunnerProcess]]:
    tmp = tmp_path_factory.mktemp("spec")
    path = write_model(tmp / "synth.gguf", model_path, "llama")
    with _split(path, slice_dir, tmp, HALVES, n_seq_max=4) as route:
        yield route


def _run(api: ApiSide, route: list[RunnerProcess], req: str, **kw: object) -> list[wire.DataChunk]:
    return api.answer(route, req, prompt=PROMPT, **kw)


@pytest.mark.parametrize("max_tokens", [7, 60])
def test_greedy_output_with_speculation_is_the_output_without(
    pipeline: list[RunnerProcess], api: ApiSide, max_tokens: int
) -> None:
    s = Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = _run(api, pipeline, f"plain-{max_tokens}", sampling=s, exact=True)
    spec = _run(api, pipeline, f"spec-{max_tokens}", sampling=s, speculate=True)
    assert tokens_of(spec) == tokens_of(plain)
    assert text_of(spec) == text_of(plain)
    assert len(tokens_of(spec)) == max_tokens
    assert plain[-1].usage.drafted_tokens == 0
    u = spec[-1].usage
    assert (u.completion_tokens, u.prompt_tokens) == (max_tokens, plain[-1].usage.prompt_tokens)
    if max_tokens == 60:
        # The random model loops, and the lookup finds the loop: most drafts hold.
        assert u.accepted_tokens > max_tokens // 3, u
        assert u.drafted_tokens >= u.accepted_tokens
        # And steps went out chained, the next before the last came back.
        assert u.chained_steps > 0, u
    # No draft model here: every draft is the lookup's.
    assert (u.model_drafted_tokens, u.model_accepted_tokens) == (0, 0), u


def test_a_seeded_sample_with_speculation_is_the_sample_without(
    pipeline: list[RunnerProcess], api: ApiSide
) -> None:
    # Each position draws its own random number: keeping a draft token exactly when
    # the draw gives it is the rejection rule, and the stream is the same.
    s = Sampling(temperature=0.7, seed=5, max_tokens=40, ignore_eos=True)
    plain = _run(api, pipeline, "seeded-plain", sampling=s, exact=True)
    spec = _run(api, pipeline, "seeded-spec", sampling=s, speculate=True)
    assert tokens_of(spec) == tokens_of(plain)
    assert spec[-1].usage.drafted_tokens > 0


def test_unasked_a_split_drafts_for_greedy_requests_and_an_exact_one_never(
    pipeline: list[RunnerProcess], api: ApiSide
) -> None:
    s = Sampling(temperature=0.0, max_tokens=30, ignore_eos=True)
    unasked = _run(api, pipeline, "unasked", sampling=s)
    assert unasked[-1].usage.drafted_tokens > 0, unasked[-1].usage
    # The exact mode turns speculation off, even where the request asks for it.
    exact = _run(api, pipeline, "exact-asked", sampling=s, exact=True, speculate=True)
    assert exact[-1].usage.drafted_tokens == 0, exact[-1].usage
    assert tokens_of(exact) == tokens_of(unasked)


def test_a_stop_string_inside_a_draft_ends_the_answer_there(
    pipeline: list[RunnerProcess], api: ApiSide
) -> None:
    s = Sampling(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = _run(api, pipeline, "stop-plain", sampling=s, exact=True)
    text = text_of(plain)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop
    cut = Sampling(temperature=0.0, max_tokens=60, ignore_eos=True, stop=[stop])
    a = _run(api, pipeline, "stop-a", sampling=cut, exact=True)
    b = _run(api, pipeline, "stop-b", sampling=cut, speculate=True)
    assert text_of(a) == text_of(b) and b[-1].finish_reason == "stop"
    assert b[-1].stop_sequence == stop


def test_one_stage_speculates_alone(
    model_path: Path, slice_dir: Path, tmp_path: Path, api: ApiSide
) -> None:
    path = write_model(tmp_path / "synth.gguf", model_path, "llama")
    with _split(path, slice_dir, tmp_path, [(0, N_LAYERS)]) as route:
        s = Sampling(temperature=0.0, max_tokens=50, ignore_eos=True)
        plain = _run(api, route, "one-plain", sampling=s, exact=True)
        spec = _run(api, route, "one-spec", sampling=s, speculate=True)
        assert tokens_of(spec) == tokens_of(plain)
        assert spec[-1].usage.accepted_tokens > 0


def test_three_stages_chain_steps_and_give_the_same_answer(
    model_path: Path, slice_dir: Path, tmp_path: Path, api: ApiSide
) -> None:
    # The stage in the middle runs the chained steps the last stage then drops, and
    # drops their KV at the step after: greedy output is still the plain one.
    path = write_model(tmp_path / "synth.gguf", model_path, "llama")
    with _split(path, slice_dir, tmp_path, [(0, 1), (1, 2), (2, N_LAYERS)]) as route:
        _chains_to_the_plain_output(api, route, "three")


def test_a_speculating_request_replayed_from_token_k_continues_exactly(
    pipeline: list[RunnerProcess], api: ApiSide
) -> None:
    # What the API node sends after losing a stage at token k: the tokens the client
    # has, re-fed one a step; drafting resumes after them and the stream is the same.
    s = Sampling(temperature=0.0, max_tokens=40, ignore_eos=True)
    # Cold, as the replays are (they reuse no prefix).
    whole = tokens_of(
        _run(api, pipeline, "spec-whole", sampling=s, speculate=True, cache_prompt=False)
    )
    for k in (1, 17):
        replay = _run(
            api, pipeline, f"spec-replay-{k}", sampling=s, speculate=True,
            resume_tokens=whole[:k],
        )  # fmt: skip
        assert tokens_of(replay) == whole[k:]
        assert replay[-1].usage.drafted_tokens > 0


def test_a_kept_answer_holds_its_own_positions_only(
    pipeline: list[RunnerProcess], api: ApiSide
) -> None:
    # Stage 0 runs chained steps ahead of the last stage; when the answer ends, the
    # ones past its last token are dropped on every stage, so a next turn that goes
    # on exactly as those steps guessed takes from the cache only what every stage
    # holds (more on stage 0 alone would fail the turn, or feed it wrong KV).
    prompt = list(range(300, 340)) * 3
    greedy = Sampling(temperature=0.0, max_tokens=40, ignore_eos=True)
    whole = tokens_of(api.answer(pipeline, "kept-whole", prompt_tokens=prompt,
                                 sampling=greedy, exact=True))  # fmt: skip
    # An exact request reuses nothing and runs cold: every kept prefix (``whole``'s
    # too) is dropped first.
    one = msgspec.structs.replace(greedy, max_tokens=1)
    api.answer(pipeline, "kept-cold", prompt_tokens=[5] * 10, sampling=one, exact=True)
    cut = msgspec.structs.replace(greedy, max_tokens=20)
    first = api.answer(pipeline, "kept-first", prompt_tokens=prompt, sampling=cut,
                       speculate=True, cache_prompt=True)  # fmt: skip
    assert tokens_of(first) == whole[:20]
    assert first[-1].usage.chained_steps > 0, first[-1].usage
    turn = msgspec.structs.replace(greedy, max_tokens=4)
    second = api.answer(pipeline, "kept-second", prompt_tokens=[*prompt, *whole[:36]],
                        sampling=turn, speculate=False, cache_prompt=True)  # fmt: skip
    # Every position before the first turn's last token (that one was never fed).
    assert second[0].n_cached == len(prompt) + 19
    assert tokens_of(second) == whole[36:40]


U = np.uint32
#: Shapes beyond the default model's where drafted rows and dropped KV could go wrong:
#: sliding-window layers (a window of 4 tokens, shorter than one chained step's reach),
#: per-head norms of queries and keys, an input scale.
ARCHITECTURES = {
    "gemma3-windowed": ("gemma3", {"gemma3.attention.sliding_window": U(4),
                                   "gemma3.attention.sliding_window_pattern": U(2)}),
    "gemma2-scaled-and-windowed": ("gemma2", {"gemma2.attention.sliding_window": U(4)}),
    "qwen3-qk-norms": ("qwen3", {}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_other_architectures_speculate_and_reuse_a_prefix_exactly(
    model_path: Path, slice_dir: Path, tmp_path: Path, api: ApiSide, case: str
) -> None:
    arch, meta = ARCHITECTURES[case]
    path = write_model(tmp_path / f"{case}.gguf", model_path, arch, metadata=meta)
    with _split(path, slice_dir, tmp_path, HALVES) as route:
        prompt = list(range(300, 340)) * 3
        greedy = Sampling(temperature=0.0, max_tokens=40, ignore_eos=True)
        whole = tokens_of(api.answer(route, f"{case}-plain", prompt_tokens=prompt,
                                     sampling=greedy, exact=True))  # fmt: skip
        one = msgspec.structs.replace(greedy, max_tokens=1)
        api.answer(route, f"{case}-cold", prompt_tokens=[5] * 10, sampling=one, exact=True)
        spec = api.answer(route, f"{case}-spec", prompt_tokens=prompt, sampling=greedy,
                          speculate=True, cache_prompt=True)  # fmt: skip
        assert tokens_of(spec) == whole
        u = spec[-1].usage
        assert u.accepted_tokens > 0 and u.chained_steps > 0, u
        # The next turn starts from what the speculating turn kept on both stages.
        turn = msgspec.structs.replace(greedy, max_tokens=6)
        second = api.answer(route, f"{case}-turn", prompt_tokens=[*prompt, *whole[:30]],
                            sampling=turn, speculate=False, cache_prompt=True)  # fmt: skip
        assert second[0].n_cached == len(prompt) + 29
        assert tokens_of(second) == whole[30:36]


def test_mlx_stages_speculate_to_the_plain_greedy_output(
    model_path: Path, slice_dir: Path, tmp_path: Path, api: ApiSide
) -> None:
    # The runner's drafting, chaining and verifying are the engine's callers: an MLX
    # split (its own KV truncation and rows of logits) gives the same stream too.
    pytest.importorskip("mlx.core")
    path = write_model(tmp_path / "synth.gguf", model_path, "llama")
    with _split(path, slice_dir, tmp_path, HALVES, engine="mlx", exact=False) as route:
        _chains_to_the_plain_output(api, route, "mlx")

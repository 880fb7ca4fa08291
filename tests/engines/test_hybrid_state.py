"""A model with recurrent layers keeps one state per request, which cannot be cut back:
its runners neither speculate, nor reuse a kept prefix, nor share one prompt's prefill
among choices (meshd.domain.recurrent). Asked for all three, a 2-stage hybrid (lfm2:
short convolutions beside attention) still answers the whole model's greedy text.
Real runner processes over real ZeroMQ, exact mode."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshd.domain.sampling import Sampling
from meshd.engines.llama_stage import LlamaStage
from meshd.engines.stage import StageInput, StageInputError
from tests.engines.chains import greedy
from tests.synthetic_archs import write_arch

from .runners import ApiSide, RunnerProcess, runner_config, tokens_of

pytestmark = pytest.mark.timeout(300)

#: Repeats itself, so a prompt lookup would find drafts if the runner drafted.
PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"
HALVES = [(0, 3), (3, 6)]  # each stage holds a recurrent and an attention layer
N = 12


@pytest.fixture(scope="module")
def hybrid(
    model_path: Path, slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, list[RunnerProcess]]]:
    tmp = tmp_path_factory.mktemp("hybrid")
    path = write_arch(tmp / "lfm2.gguf", model_path, "lfm2")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    route = [RunnerProcess(runner_config(path, slice_dir, stage=i, bounds=HALVES, exact=True,
                                         sha256=sha, n_layers=6, n_ctx=256, n_seq_max=4), tmp)
             for i in range(2)]  # fmt: skip
    try:
        yield path, route
    finally:
        for r in route:
            r.stop()


def test_a_hybrid_asked_to_speculate_cache_and_share_answers_the_whole_models_text(
    hybrid: tuple[Path, list[RunnerProcess]], api: ApiSide
) -> None:
    path, route = hybrid
    with LlamaStage(path, first=True, last=True, n_ctx=256, n_seq_max=2, exact=True) as whole:
        assert whole.recurrent
        prompt = whole.tokenize(PROMPT, add_special=False, parse_special=False)
        want, _ = greedy([whole], prompt, N)
        # The stage itself refuses to cut a recurrent state back, or to share part of it.
        whole.forward([StageInput(seq=0, pos=0, tokens=np.asarray(prompt, np.int32))])
        with pytest.raises(StageInputError):
            whole.truncate(0, 3)
        with pytest.raises(StageInputError):
            whole.share(0, 1, 3)
        whole.share(0, 1, len(prompt))  # all of it: the state itself
        assert whole.n_past(1) == len(prompt)

    s = Sampling(temperature=0.0, max_tokens=N, ignore_eos=True)
    asked = {"prompt": PROMPT, "sampling": s, "speculate": True, "cache_prompt": True}
    first = api.answer(route, "spec-1", **asked)
    assert tokens_of(first) == want
    usage = first[-1].usage
    assert usage is not None and usage.drafted_tokens == 0  # it did not speculate
    again = api.answer(route, "spec-2", **asked)  # a prefix would be reused here
    assert tokens_of(again) == want
    usage = again[-1].usage
    assert usage is not None and usage.cached_tokens == 0
    # n choices of one prompt at once: each runs the prompt, each gives the text.
    for i in range(3):
        api.generate(route, f"n-{i}", **asked)
    for i in range(3):
        chunks = api.result(f"n-{i}")
        assert not any(c.error for c in chunks), chunks
        assert tokens_of(chunks) == want


def test_a_hybrid_replayed_from_token_k_continues_exactly(
    hybrid: tuple[Path, list[RunnerProcess]], api: ApiSide
) -> None:
    # What a node sends after a stage fault: the prompt and the tokens the client has.
    # A recurrent state cannot be cut back to a kept point, so every stage runs the
    # prompt again and then those tokens one step each, as the first run did.
    _, route = hybrid
    s = Sampling(temperature=0.0, max_tokens=N, ignore_eos=True)
    first = tokens_of(api.answer(route, "replay-whole", prompt=PROMPT, sampling=s, exact=True))
    k = 5
    api.generate(route, "replay-k", prompt=PROMPT, sampling=s, resume_tokens=first[:k], exact=True)
    replay = api.result("replay-k")
    assert not any(c.error for c in replay), replay
    assert tokens_of(replay) == first[k:]

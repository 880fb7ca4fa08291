"""A real runner process serving the default model: queueing, cancel, replay, text
at the end of a stream, signals.

Every runner here is ``python -m meshd.engines.runner`` as the supervisor starts it; the
test plays the API node over real ZeroMQ sockets (see ``tests/engines/runners.py``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.domain.sampling import Sampling
from meshd.transport import wire

from .runners import ApiSide, RunnerProcess, runner_config, text_of, tokens_of

pytestmark = pytest.mark.timeout(300)

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def single(
    model_path: Path, slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunnerProcess]:
    """One runner holding the whole model, one KV slot (a second request must queue)."""
    r = RunnerProcess(
        runner_config(model_path, slice_dir, n_seq_max=1), tmp_path_factory.mktemp("single")
    )
    yield r
    r.stop()


def greedy(max_tokens: int, **kw: object) -> Sampling:
    """Greedy sampling of exactly ``max_tokens`` tokens."""
    return Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_cancelled_queued_request_is_never_admitted(single: RunnerProcess, api: ApiSide) -> None:
    api.generate([single], "a", prompt=PROMPT, sampling=greedy(48))
    api.generate([single], "b", prompt=PROMPT, sampling=greedy(8))
    api.wait("a", lambda c: bool(c.tokens), 60)  # a holds the only slot; b waits
    api.cancel(single, "b")
    a = api.result("a")
    assert a[-1].finish_reason == "length"
    api.pump(1.5)  # b, were it admitted after a, would have answered by now
    assert all(c.queued for c in api.chunks.get("b", [])), api.chunks["b"]  # its place only
    # The slot is free again: the next request runs at once.
    api.generate([single], "c", prompt=PROMPT, sampling=greedy(4))
    assert api.result("c")[-1].finish_reason == "length"
    single.wait_active(0, 5)


def test_seeded_sampling_replayed_from_position_k_continues_the_same_stream(
    single: RunnerProcess, api: ApiSide
) -> None:
    n, k = 24, 9
    sampling = Sampling(
        temperature=1.0, top_p=0.95, seed=1234, max_tokens=n, ignore_eos=True
    )  # fmt: skip
    # Exact: the whole run must not start from a prefix an earlier test left, which
    # the replay (cold, as every replay) would not see.
    api.generate([single], "whole", prompt=PROMPT, sampling=sampling, exact=True)
    whole = tokens_of(api.result("whole"))
    assert len(whole) == n
    # What the API node sends after losing a stage at token k: the same request, with
    # the tokens the client already has re-prefilled.
    api.generate(
        [single], "replay", prompt=PROMPT, sampling=sampling, resume_tokens=whole[:k], exact=True
    )
    replay = api.result("replay")
    assert tokens_of(replay) == whole[k:]
    assert replay[-1].usage == wire.Usage(replay[0].n_prompt, n)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(min_p=5.0, max_tokens=4),
        Sampling(repeat_penalty=-1.0, max_tokens=4),
        Sampling(logit_bias={10**9: 1.0}, max_tokens=4),
    ],
    ids=["min_p", "repeat_penalty", "logit_bias"],
)
def test_bad_sampling_from_the_wire_is_a_typed_error_and_the_runner_goes_on(
    single: RunnerProcess, api: ApiSide, sampling: Sampling
) -> None:
    # The API node checks these; a member's forged Generate must not crash the runner.
    api.generate([single], "bad", prompt=PROMPT, sampling=sampling)
    (chunk,) = api.result("bad")
    assert chunk.error is not None and chunk.error.code == "bad_sampling", chunk
    api.generate([single], "after", prompt=PROMPT, sampling=greedy(2))
    assert api.result("after")[-1].finish_reason == "length"
    single.wait_active(0, 5)


def test_greedy_replay_is_exact(single: RunnerProcess, api: ApiSide) -> None:
    api.generate([single], "whole", prompt=PROMPT, sampling=greedy(16), exact=True)
    whole = api.result("whole")
    api.generate(
        [single], "replay", prompt=PROMPT, sampling=greedy(16), resume_tokens=tokens_of(whole)[:5],
        exact=True,
    )  # fmt: skip
    replay = api.result("replay")
    assert tokens_of(replay) == tokens_of(whole)[5:]
    assert text_of(whole).endswith(text_of(replay))


def test_runner_ignores_sigint_and_stops_on_sigterm(
    model_path: Path, slice_dir: Path, tmp_path: Path, api: ApiSide
) -> None:
    r = RunnerProcess(runner_config(model_path, slice_dir), tmp_path)
    try:
        # What a Ctrl-C in the node's terminal sends to the whole process group.
        os.killpg(r.proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert r.alive()
        api.generate([r], "after-sigint", prompt=PROMPT, sampling=greedy(4))
        assert api.result("after-sigint")[-1].finish_reason == "length"
        r.proc.terminate()  # how the supervisor stops a runner
        r.proc.wait(10)
    finally:
        r.stop()


def test_context_is_capped_at_what_the_model_was_trained_for(
    model_path: Path, slice_dir: Path, tmp_path: Path, api: ApiSide
) -> None:
    # KV room for 9000 tokens, but SmolLM2 was trained for 8192: a prompt past that is
    # refused (positions beyond the trained context give garbage), not run.
    r = RunnerProcess(runner_config(model_path, slice_dir, n_seq_max=1, n_ctx=9000), tmp_path)
    try:
        api.generate([r], "long", prompt="hello " * 8300, sampling=greedy(4))
        (chunk,) = api.result("long")
        assert chunk.error is not None and chunk.error.code == "context_length_exceeded"
        assert "8192" in chunk.error.message
        api.generate([r], "short", prompt=PROMPT, sampling=greedy(4))
        assert len(tokens_of(api.result("short"))) == 4
    finally:
        r.stop()


def test_a_file_that_is_not_the_placed_model_is_refused(
    model_path: Path, slice_dir: Path, tmp_path: Path
) -> None:
    # Another machine's file at the same path, or another quantization of the model:
    # the runner must fail loudly, not serve other weights beside the other stages.
    cfg = runner_config(model_path, slice_dir, sha256="ab" * 32)
    with pytest.raises(RuntimeError, match="not the model that was placed"):
        RunnerProcess(cfg, tmp_path)

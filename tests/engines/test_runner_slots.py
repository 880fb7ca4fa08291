"""KV slots of a later stage come back after its pipeline breaks.

Two real runner processes split the default model; the test plays the API node. When
stage 0 dies mid-request, no cancel can reach stage 1, which still holds the request's
KV slot: before these fixes a stage with every slot taken that way answered every new
request with ``overloaded`` while it reported ready.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from meshd.domain.sampling import Sampling

from .runners import ApiSide, RunnerProcess, runner_config, tokens_of

pytestmark = pytest.mark.timeout(300)

BOUNDS = [(0, 15), (15, 30)]
PROMPT = "Once upon a time"


class Pair:
    """Runners of a 2-stage plan; stage 1 has a single KV slot."""

    def __init__(self, model_path: Path, slice_dir: Path, logs: Path, **last: object) -> None:
        self.model_path, self.slice_dir, self.logs = model_path, slice_dir, logs
        self.procs: list[RunnerProcess] = []
        self.last = self.start(1, n_seq_max=1, **last)
        self.first = self.start(0)

    def start(
        self, stage: int, generation: int = 1, then: Sequence[dict] = (), **kw: object
    ) -> RunnerProcess:
        """Start (or restart) the runner of ``stage``; ``then``: control lines sent in
        the same write as its config."""
        cfg = runner_config(
            self.model_path, self.slice_dir, stage=stage, bounds=BOUNDS, generation=generation,
            **kw,
        )  # fmt: skip
        r = RunnerProcess(cfg, self.logs, then=then)
        self.procs.append(r)
        return r

    def stop(self) -> None:
        """Stop every runner started."""
        for r in self.procs:
            r.stop()


@pytest.fixture
def make_pair(model_path: Path, slice_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Pair]]:
    """Start 2-stage plans (keywords configure stage 1); all stopped at teardown."""
    pairs: list[Pair] = []

    def make(**last: object) -> Pair:
        pairs.append(Pair(model_path, slice_dir, tmp_path, **last))
        return pairs[-1]

    yield make
    for p in pairs:
        p.stop()


@pytest.fixture
def pair(make_pair: Callable[..., Pair]) -> Pair:
    """A 2-stage plan with stage 1's default expiry."""
    return make_pair()


def long_request() -> Sampling:
    """Far more tokens than a test waits for."""
    return Sampling(temperature=0.0, max_tokens=900, ignore_eos=True)


def break_pipeline(pair: Pair, api: ApiSide, req: str) -> None:
    """Start ``req``, then kill stage 0 mid-request: stage 1 keeps its slot."""
    api.generate([pair.first, pair.last], req, prompt=PROMPT, sampling=long_request())
    api.wait(req, lambda c: len(tokens_of(api.chunks[req])) >= 3, 60)
    pair.first.kill()
    pair.last.wait_active(1, 5)


def assert_serves(pair: Pair, first: RunnerProcess, api: ApiSide, req: str) -> None:
    """A new request through ``first`` and stage 1 completes."""
    sampling = Sampling(temperature=0.0, max_tokens=6, ignore_eos=True)
    api.generate([first, pair.last], req, prompt=PROMPT, sampling=sampling)
    chunks = api.result(req, 60)
    assert chunks[-1].error is None, chunks[-1].error
    assert chunks[-1].finish_reason == "length"
    assert len(tokens_of(chunks)) == 6


def test_idle_request_expires_and_frees_its_slot(
    make_pair: Callable[..., Pair], api: ApiSide
) -> None:
    pair = make_pair(request_expiry_s=1.5)
    break_pipeline(pair, api, "broken")
    ev = pair.last.wait_event(lambda e: e["event"] == "expired", 10)
    assert ev["req"] == "broken" and ev["total"] == 1
    pair.last.wait_active(0, 5)
    # The API node hears why, should it still be waiting.
    api.wait("broken", lambda c: c.error is not None, 5)
    assert api.chunks["broken"][-1].error.code == "timeout"  # type: ignore[union-attr]
    assert_serves(pair, pair.start(0), api, "next")


def test_busy_request_does_not_expire(make_pair: Callable[..., Pair], api: ApiSide) -> None:
    """A request that keeps moving outlives a short expiry."""
    p = make_pair(request_expiry_s=0.5)
    sampling = Sampling(temperature=0.0, max_tokens=120, ignore_eos=True)
    api.generate([p.first, p.last], "long", prompt=PROMPT, sampling=sampling)
    chunks = api.result("long", 120)
    assert chunks[-1].finish_reason == "length"
    assert not [e for e in p.last.events if e["event"] == "expired"]


def test_new_generation_frees_requests_of_the_old_one(pair: Pair, api: ApiSide) -> None:
    break_pipeline(pair, api, "old")
    # The repair: stage 0 comes back elsewhere under generation 2, and the node of
    # stage 1 tells its runner the new generation.
    first = pair.start(0, generation=2)
    pair.last.control({"cmd": "generation", "value": 2})
    pair.last.wait_active(0, 5)
    api.wait("old", lambda c: c.error is not None, 5)
    assert api.chunks["old"][-1].error.code == "generation_mismatch"  # type: ignore[union-attr]
    assert_serves(pair, first, api, "new")


def test_a_generation_sent_with_the_config_is_adopted(pair: Pair, api: ApiSide) -> None:
    # A repair while stage 1's runner starts: its node sends the new generation before
    # the runner has read its config, and one read brings both lines.
    last = pair.start(1, then=[{"cmd": "generation", "value": 2}])
    last.wait_event(lambda e: e["event"] == "generation" and e["value"] == 2, 10)
    pair.last = last
    assert_serves(pair, pair.start(0, generation=2), api, "new")


def test_cancel_of_an_unknown_request_is_accepted_and_remembered(pair: Pair, api: ApiSide) -> None:
    # A cancel sent to every stage may reach stage 1 before the request's first
    # activation (two senders, no order between them).
    api.cancel(pair.last, "ghost")
    api.cancel(pair.last, "gone")
    api.generate([pair.first, pair.last], "gone", prompt=PROMPT, sampling=long_request())
    api.wait("gone", lambda c: c.n_prompt is not None, 30)  # stage 0 took it
    api.pump(2.0)
    assert not tokens_of(api.chunks["gone"])  # stage 1 never ran it
    assert pair.last.active() == 0
    assert "ghost" not in api.chunks
    assert_serves(pair, pair.first, api, "next")

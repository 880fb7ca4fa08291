"""Stage 0's queue in a real runner process: requests past its sequences wait their
turn, each told its place, and the turns go round the clients.

One whole-model runner with a single KV sequence; the test plays the API node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.domain.sampling import Sampling

from .runners import ApiSide, RunnerProcess, runner_config

pytestmark = pytest.mark.timeout(180)

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def runner(
    model_path: Path, slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunnerProcess]:
    r = RunnerProcess(
        runner_config(model_path, slice_dir, n_seq_max=1), tmp_path_factory.mktemp("queue")
    )
    yield r
    r.stop()


def _acked(api: ApiSide, req: str) -> bool:
    return any(c.n_prompt for c in api.chunks.get(req, []))


def test_waiting_requests_hear_their_place_and_clients_take_turns(
    runner: RunnerProcess, api: ApiSide
) -> None:
    hog = Sampling(temperature=0.0, max_tokens=40, ignore_eos=True)
    short = Sampling(temperature=0.0, max_tokens=3, ignore_eos=True)
    api.generate([runner], "hog", prompt=PROMPT, sampling=hog, client="A")
    api.wait("hog", lambda c: c.n_prompt is not None, 30)
    for req in ("a1", "a2", "a3"):
        api.generate([runner], req, prompt=PROMPT, sampling=short, client="A")
    api.generate([runner], "b1", prompt=PROMPT, sampling=short, client="B")
    # Each is told its place at once: A holds the seat, so B's one goes first.
    for req in ("a1", "a2", "a3", "b1"):
        api.wait(req, lambda c: c.queued > 0, 10)
    first = {req: next(c.queued for c in api.chunks[req] if c.queued) for req in ("a3", "b1")}
    assert first == {"a3": 3, "b1": 1}, api.chunks
    runner.wait_event(lambda e: e["event"] == "load" and e.get("waiting") == 4, 10)
    # The answers: every one whole, admitted B first, then A's in their order.
    for req in ("hog", "a1", "a2", "a3", "b1"):
        chunks = api.result(req, 60)
        assert chunks[-1].finish_reason == "length", chunks[-1]
    order = [c.req for c in api.arrived if c.n_prompt]
    assert order == ["hog", "b1", "a1", "a2", "a3"], order
    waited = {req: next(c.waited_s for c in api.chunks[req] if c.n_prompt) for req in order}
    assert waited["hog"] == 0.0 and all(waited[r] > 0 for r in order[1:]), waited
    assert waited["b1"] < waited["a1"] < waited["a2"] < waited["a3"], waited
    runner.wait_event(lambda e: e["event"] == "load" and e.get("waiting", 0) == 0
                      and e["active"] == 0, 10)  # fmt: skip


def test_a_request_cancelled_while_it_waits_leaves_the_queue(
    runner: RunnerProcess, api: ApiSide
) -> None:
    hog = Sampling(temperature=0.0, max_tokens=30, ignore_eos=True)
    api.generate([runner], "hog2", prompt=PROMPT, sampling=hog, client="A")
    api.wait("hog2", lambda c: c.n_prompt is not None, 30)
    api.generate([runner], "gone", prompt=PROMPT, sampling=hog, client="B")
    api.wait("gone", lambda c: c.queued == 1, 10)
    api.cancel(runner, "gone")
    api.generate([runner], "next", prompt=PROMPT, sampling=hog, client="C")
    api.wait("next", lambda c: c.queued == 1, 10)  # the cancelled one is no longer ahead
    api.result("hog2", 60)
    api.result("next", 60)
    assert not _acked(api, "gone")

"""Drafts from a draft model's runner: stage 0 of a target asks it for the next tokens,
the target verifies them in one pass, and what the user gets is what the target alone
writes. Real runner processes over real ZeroMQ (a wiretap counts the asks on their
way), and the draft side against a real engine in this process."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from meshd.domain.sampling import Sampling
from meshd.engines.draft_model import DraftClient, DraftServer
from meshd.engines.drafting import TRIAL_STEPS
from meshd.engines.llama_stage import LlamaStage
from meshd.engines.stage import StageInput
from meshd.transport import wire
from tests.synthetic import write_f32_model, write_model

from .runners import N_LAYERS, ApiSide, RunnerProcess, runner_config, text_of, tokens_of

pytestmark = pytest.mark.timeout(300)

#: Words that do not repeat: prompt lookup finds little, the draft model drafts.
PROMPT = "Tell me about the weather in Lisbon, the food in Porto and trains to Madrid."


class Tap:
    """A ROUTER that passes every message on to one runner and counts them by type:
    what stage 0 sent the draft model, seen on the wire."""

    def __init__(self, to: wire.Addr | None) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.out = None
        if to is not None:
            self.out = self.ctx.socket(zmq.DEALER)
            self.out.setsockopt(zmq.LINGER, 0)
            self.out.connect(f"tcp://127.0.0.1:{to.port}")
        self.seen: list[wire.StageMessage] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> wire.Addr:
        return wire.Addr(node="tap", addresses=["127.0.0.1"], port=self.port)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            self.seen.append(wire.decode_stage(frames[1]))
            if self.out is not None:
                self.out.send_multipart(frames[1:])

    def asks(self) -> list[wire.Propose]:
        return [m for m in self.seen if isinstance(m, wire.Propose) and m.k > 0]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def synth(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = write_model(tmp_path_factory.mktemp("draft") / "synth.gguf", model_path, "llama")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def runners(
    model_path: Path, slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[RunnerProcess], RunnerProcess]]:
    """The default model's weights in F32 over two stages, and a draft runner of the
    same weights (its greedy drafts are what the target writes, so most are accepted).
    A real model: a random one soon loops, and then prompt lookup drafts everything.
    F32 in exact mode: a batch of rows sums as one row a step does (a quantized model's
    batched kernels do not), so greedy output must be the same token for token."""
    tmp = tmp_path_factory.mktemp("draft-runners")
    path = tmp / "smollm2-f32.gguf"
    write_f32_model(model_path, path, N_LAYERS)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    bounds = [(0, 15), (15, N_LAYERS)]
    common = {"exact": True, "n_ctx": 512, "sha256": sha}
    target = [
        RunnerProcess(
            runner_config(
                path, slice_dir, stage=i, bounds=bounds, n_seq_max=4, instance="target", **common
            ),
            tmp,
        )
        for i in range(2)
    ]
    draft = RunnerProcess(runner_config(path, slice_dir, instance="draft", **common), tmp)
    yield target, draft
    for r in [*target, draft]:
        r.stop()


def _set_draft(stage0: RunnerProcess, instance: str | None, addr: wire.Addr | None) -> None:
    stage0.control({"cmd": "draft", "instance": instance,
                    "addr": [addr.node, addr.addresses, addr.port] if addr else None})  # fmt: skip


def _run(api: ApiSide, route: list[RunnerProcess], req: str, **kw: object) -> list[wire.DataChunk]:
    return api.answer(route, req, prompt=PROMPT, **kw)


def test_greedy_output_with_a_draft_model_is_the_output_without(
    runners: tuple[list[RunnerProcess], RunnerProcess], api: ApiSide
) -> None:
    target, draft = runners
    tap = Tap(draft.addr)
    try:
        _set_draft(target[0], "draft", tap.addr)
        s = Sampling(temperature=0.0, max_tokens=40, ignore_eos=True)
        plain = _run(api, target, "plain", sampling=s, exact=True)
        assert not tap.asks()  # a request that does not speculate never asks
        # An answer that comes after its step gave up waiting is dropped (a draft
        # model must never slow a stream): on a starved machine every answer of a run
        # may come late. So up to 3 runs, until one held a draft of the model's; each
        # must give the plain tokens.
        for attempt in range(3):
            tap.seen.clear()
            spec = _run(api, target, f"spec-{attempt}", sampling=s, speculate=True)
            assert tokens_of(spec) == tokens_of(plain)
            assert text_of(spec) == text_of(plain)
            if spec[-1].usage.model_drafted_tokens > 0:
                break
        asks = tap.asks()
        assert asks, "stage 0 never asked the draft model"
        # The prompt went ahead at admission; each ask after carries only what the
        # draft runner lacks (tokens written since its last draft), never the prompt.
        # (Asks sent before the prime's answer came back carry it too, as on a busy
        # machine: only an answer says what the draft runner holds. Once one did, none.)
        primes = [m for m in tap.seen if isinstance(m, wire.Propose) and m.k == 0]
        assert len(primes) == 1 and primes[0].pos == 0
        lean = [m.pos >= len(primes[0].tokens) for m in asks]
        assert lean == sorted(lean), asks
        u = spec[-1].usage
        # The usage tells the model's drafts from the lookup's (they crossed the split
        # named as the model's): at most what was asked (an answer that comes after
        # its step gave up waiting is dropped, as a loaded machine makes some), and,
        # the weights being the same, the target's own greedy tokens: nearly all held.
        assert 0 < u.model_drafted_tokens <= sum(m.k for m in asks), (u, asks)
        assert u.model_accepted_tokens >= 0.9 * u.model_drafted_tokens, u
        assert u.model_drafted_tokens <= u.drafted_tokens, u
        assert u.model_accepted_tokens <= u.accepted_tokens, u
        # The request's end freed its sequence on the draft runner.
        deadline = time.monotonic() + 5
        while not any(isinstance(m, wire.Release) for m in tap.seen):
            assert time.monotonic() < deadline, "no release reached the draft runner"
            time.sleep(0.05)
    finally:
        _set_draft(target[0], None, None)
        tap.close()


def test_a_replay_with_a_draft_model_continues_exactly(
    runners: tuple[list[RunnerProcess], RunnerProcess], api: ApiSide
) -> None:
    target, draft = runners
    _set_draft(target[0], "draft", draft.addr)
    try:
        s = Sampling(temperature=0.0, max_tokens=30, ignore_eos=True)
        # Cold, as the replay is (it reuses no prefix).
        whole = tokens_of(
            _run(api, target, "replay-whole", sampling=s, speculate=True, cache_prompt=False)
        )
        replay = _run(api, target, "replay-9", sampling=s, speculate=True, resume_tokens=whole[:9])
        assert tokens_of(replay) == whole[9:]
        assert replay[-1].usage.drafted_tokens > 0
    finally:
        _set_draft(target[0], None, None)


def test_a_sampled_request_keeps_the_drafts_the_model_would_draw(
    runners: tuple[list[RunnerProcess], RunnerProcess], api: ApiSide
) -> None:
    # The rejection rule is the one prompt lookup's drafts go through (test_speculation
    # shows a seeded stream unchanged by it, where a batch of rows sums exactly as one
    # row a step): here, that a sampled request gets drafts and keeps some. A greedy
    # draft token is kept with the probability the target gives it (the rule for a
    # draft that is one token for sure), so not all of them, even from the target.
    target, draft = runners
    _set_draft(target[0], "draft", draft.addr)
    try:
        # Seeded: the draws, so how many drafts are kept, are the same on every run
        # (unseeded, a run whose first few drafts all lose stops drafting).
        s = Sampling(temperature=0.7, seed=11, max_tokens=40, ignore_eos=True)
        spec = _run(api, target, "sampled-spec", sampling=s, speculate=True)
        u = spec[-1].usage
        assert u.completion_tokens == 40 and len(tokens_of(spec)) == 40
        assert u.drafted_tokens > 0 and u.accepted_tokens > 0, u
    finally:
        _set_draft(target[0], None, None)


def test_a_draft_model_that_never_answers_does_not_stall_a_request(
    runners: tuple[list[RunnerProcess], RunnerProcess], api: ApiSide
) -> None:
    target, _ = runners
    black_hole = Tap(None)  # takes every ask, answers none
    try:
        _set_draft(target[0], "draft", black_hole.addr)
        s = Sampling(temperature=0.0, max_tokens=30, ignore_eos=True)
        plain = _run(api, target, "hole-plain", sampling=s, exact=True)
        t0 = time.monotonic()
        spec = _run(api, target, "hole-spec", sampling=s, speculate=True)
        took = time.monotonic() - t0
        assert tokens_of(spec) == tokens_of(plain)
        # Each unanswered ask costs at most its wait, and the budget stops asking after
        # a trial of drafted steps (an unanswered ask counts as a draft that failed).
        asked = [m for m in black_hole.asks() if m.req == "hole-spec"]
        assert 0 < len(asked) <= TRIAL_STEPS, asked
        assert took < 15, took
        # The node changes its mind while a step waits for an answer: the step runs.
        long = Sampling(temperature=0.0, max_tokens=60, ignore_eos=True)
        api.generate(target, "switched", prompt=PROMPT, sampling=long, speculate=True)
        deadline = time.monotonic() + 30
        while not any(m.req == "switched" for m in black_hole.asks()):
            assert time.monotonic() < deadline, "stage 0 never asked"
            time.sleep(0.002)
        _set_draft(target[0], None, None)
        chunks = api.result("switched", timeout=30)
        assert not any(c.error for c in chunks) and len(tokens_of(chunks)) == 60
    finally:
        _set_draft(target[0], None, None)
        black_hole.close()


# -- the draft side against a real engine ---------------------------------------------


def _greedy(stage: LlamaStage, seq: int, tokens: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``tokens``, one step at a time, on a fresh sequence."""
    stage.free(seq)
    out = stage.forward([StageInput(seq=seq, pos=0, tokens=np.asarray(tokens, np.int32))])[0]
    got = [int(np.argmax(out))]
    while len(got) < n:
        pos = len(tokens) + len(got) - 1
        out = stage.forward([StageInput(seq=seq, pos=pos, tokens=np.asarray(got[-1:], np.int32))])[
            0
        ]
        got.append(int(np.argmax(out)))
    stage.free(seq)
    return got


def test_the_draft_side_follows_what_stage_0_holds(synth: tuple[Path, str]) -> None:
    path, _ = synth
    sent: list[wire.Message] = []
    free = [2, 1, 0]
    me = wire.Addr(node="t", addresses=["127.0.0.1"], port=1)
    with LlamaStage(path, first=True, last=True, n_ctx=128, n_seq_max=3, exact=True) as s:
        server = DraftServer(s, 128, lambda: free.pop() if free else None, free.append,
                             lambda _a, m: sent.append(m))  # fmt: skip

        def to_server(_a: wire.Addr, m: wire.Message) -> None:
            if isinstance(m, wire.Propose):
                server.ask(m)
            elif isinstance(m, wire.Release):
                server.release(m.req)

        client = DraftClient("target", to_server)
        client.set("draft", me)
        prompt = s.tokenize(PROMPT, add_special=True, parse_special=False)

        def ask(tokens: list[int], k: int) -> list[int]:
            client.ask("r", tokens, k, me, 1.0)
            server.run()
            got = client.answer(sent.pop())  # type: ignore[arg-type]
            assert got is not None and got[0].pos == len(tokens) - 1
            return got[1]

        client.prime("r", prompt[:-1], me)
        server.run()
        assert client.answer(sent.pop()) is None  # type: ignore[arg-type]
        assert client.held["r"] == len(prompt) - 1
        d1 = ask(prompt, 4)
        assert d1 == _greedy(s, 2, prompt, 4)
        # Stage 0 kept two of the draft and then fed another token: the draft side
        # drops the rest of what it held and continues from the new text.
        client.truncated("r", len(prompt) + 2)
        text = [*prompt, *d1[:2], 42]
        d2 = ask(text, 3)
        assert d2 == _greedy(s, 2, text, 3)
        assert client.held["r"] == len(text) + 2  # the last draft token is never fed
        # A context the draft model cannot hold: it says so, and is not asked again.
        client.ask("r", [*text, *[7] * 130], 3, me, 1.0)
        server.run()
        got = client.answer(sent.pop())  # type: ignore[arg-type]
        assert got is not None and got[1] == []  # the step runs without a draft
        assert not client.usable("r")
        assert sorted(free) == [0, 1, 2]  # its sequence came back
        # A request that ended frees its sequence there.
        client.prime("q", prompt, me)
        server.run()
        assert len(free) == 2
        client.forget("q")
        assert len(free) == 3 and not server.held

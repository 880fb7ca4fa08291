"""llama.cpp pipeline stages on the real default model: chains match the whole model."""

from __future__ import annotations

import itertools
import os
import platform
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from meshd.engines.ggml_lib import cpu_extra_buffer_types
from meshd.engines.llama_stage import LlamaStage, _get_backend
from meshd.engines.stage import ContextFullError, StageInput, StageInputError
from meshd.engines.threads import runner_env
from meshd.models.slicing import slice_gguf
from tests.conftest import MODEL_SHA256
from tests.engines.chains import greedy

REPO = Path(__file__).resolve().parents[2]
N_CTX = 1024
N_GEN = 10
LOGITS_TOL = 1e-4

PROMPTS = {
    "short": "Once upon a time",
    "non_ascii": (
        "Überraschung! Ein Café in Zürich, naïve crème brûlée — 日本語の文章。Привет, мир! 🙂"
    ),
    "chat": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    # 256 tokens (the chain test holds it to at least 250): every long prompt's token
    # costs each run ~10 ms of prefill, the most of any part of this file.
    "long": " ".join(
        f"Note {i}: the quick brown fox jumps over the lazy dog near river {i % 7}."
        for i in range(14)
    ),
}


def _tokens(stage: LlamaStage, text: str) -> list[int]:
    # parse_special so the chat prompt's <|im_start|> markers are control tokens.
    return stage.tokenize(text, add_special=False, parse_special=True)


def _greedy(
    chain: Sequence[LlamaStage], prompt: Sequence[int], n: int = N_GEN, seq: int = 0
) -> tuple[list[int], list[np.ndarray]]:
    return greedy(chain, prompt, n, seq)


@pytest.fixture(scope="module")
def whole(model_path: Path) -> Iterator[LlamaStage]:
    """The whole model as one stage, exact numerics."""
    with LlamaStage(model_path, first=True, last=True, n_ctx=N_CTX, n_seq_max=2, exact=True) as s:
        yield s


@pytest.fixture(scope="module")
def three_stages(model_path: Path, slice_dir: Path) -> Iterator[list[LlamaStage]]:
    """Layers [0,10), [10,20), [20,30) as three in-process stages, exact numerics."""
    ranges = [(0, 10), (10, 20), (20, 30)]
    paths = [slice_gguf(model_path, a, b, slice_dir, MODEL_SHA256) for a, b in ranges]
    stages = [
        LlamaStage(p, first=i == 0, last=i == 2, n_ctx=N_CTX, n_seq_max=2, exact=True)
        for i, p in enumerate(paths)
    ]
    yield stages
    for s in stages:
        s.close()


@pytest.fixture(scope="module")
def two_stages(model_path: Path, slice_dir: Path) -> Iterator[list[LlamaStage]]:
    """Layers [0,10) and [10,30) as two stages holding up to three requests.

    Flash attention with f16 K/V (a GPU stage's, or a quantized cache's): its CPU
    kernel skips masked cells one by one, so a request's result does not depend on
    where its cells sit in the KV cache that it shares with the others, and batches
    can be held to ~1e-4. (The CPU default, plain attention, sums a masked matmul
    whose rounding does: up to ~0.8 in logits on this model, whose residual stream
    reaches ~3e4.)
    """
    paths = [slice_gguf(model_path, a, b, slice_dir, MODEL_SHA256) for a, b in [(0, 10), (10, 30)]]
    stages = [
        LlamaStage(p, first=i == 0, last=i == 1, n_ctx=N_CTX, n_seq_max=3, flash_attn=True)
        for i, p in enumerate(paths)
    ]
    yield stages
    for s in stages:
        s.close()


@pytest.mark.timeout(400)
def test_three_stage_chain_matches_whole_model(
    model_path: Path, whole: LlamaStage, three_stages: list[LlamaStage]
) -> None:
    from llama_cpp import Llama

    assert [s.n_layers for s in three_stages] == [10, 10, 10]
    assert whole.n_layers == 30
    # The reference the product promises: llama-cpp-python's own high-level class,
    # with the same numerics (no flash attention, f32 K/V) and the same batch size.
    llm = Llama(
        model_path=str(model_path),
        n_ctx=N_CTX,
        n_batch=whole.n_batch,
        n_ubatch=whole.n_batch,
        n_threads=whole.n_threads,
        n_threads_batch=whole.n_threads,
        flash_attn=False,
        type_k=0,
        type_v=0,
        verbose=False,
    )
    try:
        lengths = {}
        for name, text in PROMPTS.items():
            prompt = _tokens(whole, text)
            lengths[name] = len(prompt)
            assert prompt == llm.tokenize(text.encode(), add_bos=False, special=True), name

            one, one_logits = _greedy([whole], prompt)
            three, three_logits = _greedy(three_stages, prompt)
            assert three == one, name
            worst = max(
                float(np.abs(a - b).max()) for a, b in zip(one_logits, three_logits, strict=True)
            )
            assert worst <= LOGITS_TOL, (name, worst)

            reference = list(
                itertools.islice(llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0), N_GEN)
            )
            assert one == reference, name
        assert lengths["long"] >= 250
    finally:
        llm.close()


@pytest.mark.timeout(120)
def test_interleaved_requests_in_one_batch_match_each_alone(
    two_stages: list[LlamaStage],
) -> None:
    first, last = two_stages
    a_prompt = _tokens(first, PROMPTS["short"])
    b_prompt = _tokens(first, PROMPTS["non_ascii"])
    n = 12
    a_alone, a_alone_logits = _greedy(two_stages, a_prompt, n, seq=0)
    b_alone, b_alone_logits = _greedy(two_stages, b_prompt, n, seq=1)

    # Together: b starts two steps after a, so one batch mixes a's single-token
    # decode with b's whole prefill; every later batch carries both requests.
    state = {0: (a_prompt, 0, [], []), 1: (b_prompt, 0, [], [])}
    for step in range(n + 2):
        active = [s for s in (0, 1) if not (s == 1 and step < 2) and len(state[s][2]) < n]
        items = [
            StageInput(seq=s, pos=state[s][1], tokens=np.asarray(state[s][0], np.int32))
            for s in active
        ]
        hidden = first.forward(items)
        logits = last.forward(
            [
                StageInput(seq=it.seq, pos=it.pos, hidden=h)
                for it, h in zip(items, hidden, strict=True)
            ]
        )
        for it, lg in zip(items, logits, strict=True):
            cur, pos, toks, lgs = state[it.seq]
            tok = int(np.argmax(lg))
            state[it.seq] = ([tok], pos + len(cur), [*toks, tok], [*lgs, lg])
    assert state[0][2] == a_alone
    assert state[1][2] == b_alone
    for got, alone in ((state[0][3], a_alone_logits), (state[1][3], b_alone_logits)):
        assert (
            max(float(np.abs(x - y).max()) for x, y in zip(got, alone, strict=True)) <= LOGITS_TOL
        )

    # free releases the sequence: seq 0 is empty again on both stages and a new
    # request reusing it (while seq 1 still holds its cache) gets the right answer.
    for stage in two_stages:
        assert stage.n_past(0) == len(a_prompt) + n - 1
        stage.free(0)
        assert stage.n_past(0) == 0
        assert stage.n_past(1) == len(b_prompt) + n - 1
    c_prompt = _tokens(first, PROMPTS["chat"])
    c_reused, _ = _greedy(two_stages, c_prompt, n, seq=0)
    for stage in two_stages:
        stage.free(1)
    c_alone, _ = _greedy(two_stages, c_prompt, n, seq=2)
    assert c_reused == c_alone


@pytest.mark.timeout(90)
def test_prefill_longer_than_the_batch_is_split_in_order(
    model_path: Path, slice_dir: Path, whole: LlamaStage
) -> None:
    head = slice_gguf(model_path, 0, 10, slice_dir, MODEL_SHA256)
    prompt_a = np.asarray(_tokens(whole, PROMPTS["non_ascii"]), np.int32)
    prompt_b = np.asarray(_tokens(whole, PROMPTS["chat"]), np.int32)
    kw = {"first": True, "last": False, "n_ctx": N_CTX, "n_seq_max": 2, "exact": True}
    # Batches of 8 rows: short prompts span several of them (long ones prove no more).
    with LlamaStage(head, n_batch=512, **kw) as big, LlamaStage(head, n_batch=8, **kw) as small:
        assert small.n_batch == 8
        # Two requests in one call, 49 + 16 tokens in 9 batches: request a spans
        # seven decodes and b starts inside the last of them.
        assert len(prompt_a) % small.n_batch and len(prompt_a) > 4 * small.n_batch
        items = [StageInput(0, 0, tokens=prompt_a), StageInput(1, 0, tokens=prompt_b)]
        chunked = small.forward(items)
        ref_a = big.forward([items[0]])[0]
        ref_b = big.forward([items[1]])[0]
        assert chunked[0].shape == (len(prompt_a), big.hidden_size)
        assert chunked[1].shape == (len(prompt_b), big.hidden_size)
        np.testing.assert_allclose(chunked[0], ref_a, atol=1e-4)
        np.testing.assert_allclose(chunked[1], ref_b, atol=1e-4)
        assert small.n_past(0) == len(prompt_a) and small.n_past(1) == len(prompt_b)

    # Logits of a split prefill match the unsplit one (and name the same token).
    with LlamaStage(
        model_path, first=True, last=True, n_ctx=N_CTX, n_seq_max=1, exact=True, n_batch=8
    ) as one:
        split = one.forward([StageInput(0, 0, tokens=prompt_a)])[0]
    unsplit = whole.forward([StageInput(0, 0, tokens=prompt_a)])[0]
    whole.free(0)
    assert split.shape == (whole.n_vocab,)
    assert float(np.abs(split - unsplit).max()) <= LOGITS_TOL
    assert int(np.argmax(split)) == int(np.argmax(unsplit))


@pytest.mark.timeout(60)
def test_a_one_token_step_of_a_whole_model_matches_the_general_path(model_path: Path) -> None:
    # A step of one token per request takes a shorter path through forward(); the
    # general one runs when any item has more rows. Same logits, same refusals.
    with LlamaStage(
        model_path, first=True, last=True, n_ctx=N_CTX, n_seq_max=3, exact=True
    ) as stage:
        prompt = np.asarray(_tokens(stage, PROMPTS["short"]), np.int32)
        n = len(prompt)
        start = stage.forward([StageInput(0, 0, tokens=prompt), StageInput(1, 0, tokens=prompt)])
        tok = np.asarray([int(np.argmax(start[0]))], np.int32)
        (step,) = stage.forward([StageInput(0, n, tokens=tok)])
        general = stage.forward(
            [StageInput(1, n, tokens=tok), StageInput(2, 0, tokens=prompt[:2])]
        )[0]
        assert step.shape == (stage.n_vocab,)
        assert float(np.abs(step - general).max()) <= LOGITS_TOL
        # Several requests in one step: each its own logits, in item order.
        nxt = np.asarray([int(np.argmax(step))], np.int32)
        both = stage.forward([StageInput(1, n + 1, tokens=nxt), StageInput(0, n + 1, tokens=nxt)])
        assert float(np.abs(both[0] - both[1]).max()) <= LOGITS_TOL
        assert stage.n_past(0) == stage.n_past(1) == n + 2

        for bad in (
            [StageInput(0, n + 5, tokens=nxt)],  # not where seq 0 is
            [StageInput(0, n + 2, tokens=nxt), StageInput(0, n + 2, tokens=nxt)],  # twice
            [StageInput(0, n + 2, tokens=np.asarray([stage.n_vocab], np.int32))],
            [StageInput(3, 0, tokens=nxt)],  # seq id past n_seq_max
        ):
            with pytest.raises(StageInputError):
                stage.forward(bad)
        assert stage.n_past(0) == n + 2  # nothing was decoded by the refused calls

    with LlamaStage(model_path, first=True, last=True, n_ctx=8, n_seq_max=1) as tiny:
        tiny.forward([StageInput(0, 0, tokens=np.arange(1, 9, dtype=np.int32))])
        with pytest.raises(ContextFullError):
            tiny.forward([StageInput(0, 8, tokens=np.asarray([5], np.int32))])
        assert tiny.n_past(0) == 8


@pytest.mark.timeout(60)
def test_stage_refuses_inputs_that_do_not_fit(
    model_path: Path, three_stages: list[LlamaStage]
) -> None:
    first, middle, _ = three_stages
    toks = np.asarray([1, 2, 3], np.int32)
    rows = np.zeros((3, middle.hidden_size), np.float32)
    with pytest.raises(StageInputError):
        middle.forward([StageInput(0, 0, tokens=toks)])  # a middle stage takes rows
    with pytest.raises(StageInputError):
        first.forward([StageInput(0, 0, tokens=toks, hidden=rows)])  # tokens, or rows alone
    with pytest.raises(StageInputError):
        first.forward([StageInput(0, 0, hidden=rows[:, :10])])  # rows as wide as the model
    with pytest.raises(StageInputError):
        middle.forward([StageInput(0, 0, hidden=rows[:, :10])])
    with pytest.raises(StageInputError):
        first.forward([StageInput(0, 5, tokens=toks)])  # nothing held yet: pos must be 0
    with pytest.raises(StageInputError):
        first.forward([StageInput(0, 0, tokens=toks), StageInput(0, 0, tokens=toks)])
    with pytest.raises(StageInputError):
        first.forward([StageInput(7, 0, tokens=toks)])  # seq id past n_seq_max
    with pytest.raises(StageInputError):
        first.forward([StageInput(0, 0, tokens=np.asarray([first.n_vocab], np.int32))])
    assert first.n_past(0) == 0  # nothing was decoded by the refused calls

    with LlamaStage(model_path, first=True, last=True, n_ctx=8, n_seq_max=2) as tiny:
        tiny.forward([StageInput(0, 0, tokens=np.arange(5, 10, dtype=np.int32))])
        with pytest.raises(ContextFullError):
            tiny.forward([StageInput(0, 5, tokens=np.arange(10, 14, dtype=np.int32))])
        # Each sequence gets the whole n_ctx, whatever the others hold.
        out = tiny.forward([StageInput(1, 0, tokens=np.arange(1, 9, dtype=np.int32))])
        assert out[0].shape == (tiny.n_vocab,)
        assert tiny.n_past(0) == 5 and tiny.n_past(1) == 8


@pytest.mark.timeout(120)
def test_every_sequence_can_fill_its_context_in_a_fragmented_cache(
    model_path: Path, slice_dir: Path
) -> None:
    # The cache is the same whatever the layers: one layer's stage fills it 7x faster
    # than the whole model's.
    head = slice_gguf(model_path, 0, 1, slice_dir, MODEL_SHA256)
    # 2 x 128 positions: exactly the 256 cells llama.cpp allocates (it pads to 256).
    with LlamaStage(head, first=True, last=False, n_ctx=128, n_seq_max=2) as stage:
        one = np.asarray([100], np.int32)
        for pos in range(128):
            # One row each per step: the two requests' cells alternate in the cache.
            stage.forward([StageInput(0, pos, tokens=one), StageInput(1, pos, tokens=one)])
        stage.free(0)
        # Seq 0's cells are now 128 single-cell holes; a full-length prefill fits.
        out = stage.forward([StageInput(0, 0, tokens=np.arange(300, 428, dtype=np.int32))])
        assert out[0].shape == (128, stage.hidden_size)
        assert (stage.n_past(0), stage.n_past(1)) == (128, 128)


@pytest.mark.timeout(60)
def test_tokenizer_helpers_work_on_every_slice(three_stages: list[LlamaStage]) -> None:
    text = PROMPTS["non_ascii"]
    for stage in three_stages:
        toks = stage.tokenize(text, add_special=False, parse_special=False)
        # Pieces are raw bytes: joined, they are the UTF-8 text again, although some
        # single pieces are not valid UTF-8 on their own.
        assert b"".join(stage.token_to_piece(t) for t in toks) == text.encode()
        assert stage.tokenize("<|im_start|>", add_special=False, parse_special=True) == [1]
        assert stage.token_to_piece(2) == b""
        assert stage.token_to_piece(2, special=True) == b"<|im_end|>"
        assert {0, 2} <= stage.eos_tokens()
        assert (stage.n_vocab, stage.hidden_size) == (49152, 576)


_CONFIGURE = """
import os, sys
from meshd.engines.threads import configure_threads
if sys.argv[1] == "late":
    import llama_cpp
ok = configure_threads()
print(ok, os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.timeout(60)
def test_thread_settings_are_set_only_when_asked_and_only_while_they_can_work() -> None:
    env = runner_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": "10000"}
    assert runner_env({"GOMP_SPINCOUNT": "5"})["GOMP_SPINCOUNT"] == "5"

    # In a fresh process: importing the stage module loads no llama.cpp (so libgomp
    # has not read its environment yet) and configure_threads() takes effect; once
    # llama_cpp is loaded it is too late, and it says so instead of pretending.
    clean = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    for when, expected in (("early", "True 10000"), ("late", "False None")):
        out = subprocess.run(
            [sys.executable, "-c", _CONFIGURE, when],
            cwd=REPO,
            env=clean,
            capture_output=True,
            text=True,
            timeout=50,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected


def test_stages_know_the_builds_cpu_buffer_types_and_whether_it_has_amx() -> None:
    import llama_cpp

    names = cpu_extra_buffer_types(llama_cpp)
    assert all(isinstance(n, str) and n for n in names)
    if platform.machine() == "x86_64":
        assert "CPU_REPACK" in names  # llama.cpp's default CPU build repacks Q4_0 & co.
    # What LlamaStage loads with follows the build (a stage forward on an AMX build
    # would crash the process: llama.cpp #20824).
    assert _get_backend().amx == ("AMX" in names)


def test_plain_attention_holds_its_scores_to_a_budget_by_taking_fewer_rows_a_call(
    model_path: Path,
) -> None:
    from meshd.engines.llama_stage import PLAIN_ATTENTION_BYTES

    # 8 sequences of 4,096: 32,768 cells x 9 heads x 4 bytes a row of scores.
    plain = LlamaStage(model_path, first=True, last=True, n_ctx=4096, n_seq_max=8)
    with plain:
        assert plain.flash_attn is False
        assert plain.n_batch == PLAIN_ATTENTION_BYTES // (32768 * 9 * 4) < 512
        # A prompt of several calls (256 tokens: 3 of up to 113) gives what one call of
        # flash attention does; its top logit leads by 2.4 on both, so no tie can flip.
        prompt = np.asarray(_tokens(plain, PROMPTS["long"]), np.int32)
        assert len(prompt) > 2 * plain.n_batch
        got = plain.forward([StageInput(seq=0, pos=0, tokens=prompt)])[0]
    with LlamaStage(
        model_path, first=True, last=True, n_ctx=4096, n_seq_max=8, flash_attn=True
    ) as flash:
        assert flash.n_batch == 512
        want = flash.forward([StageInput(seq=0, pos=0, tokens=prompt)])[0]
    assert int(np.argmax(got)) == int(np.argmax(want))

"""Embeddings at the last stage: the final hidden states of an input, pooled."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshd.engines.llama_stage import LlamaStage
from meshd.engines.stage import StageInput, StageInputError
from meshd.models.pooling import pool, pooling_of
from tests.synthetic import N_LAYERS, write_bert, write_model

TEXTS = ["The cat sat on the mat.", "Quantum physics is hard to learn", "hello"]


def _tokens(stage, text: str) -> np.ndarray:
    return np.asarray(stage.tokenize(text, add_special=True, parse_special=False), np.int32)


def test_vectors_match_llama_cpp_python_and_leave_the_sequences_alone(model_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(
        str(model_path), embedding=True, verbose=False, n_ctx=512,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    )  # fmt: skip
    want = np.asarray(ref.embed(TEXTS, normalize=True))
    with LlamaStage(model_path, first=True, last=True, n_ctx=512, n_seq_max=2) as s:
        # A generation in flight on seq 0 must not see the embeddings.
        prompt = _tokens(s, "Once upon a time")
        before = s.forward([StageInput(seq=0, pos=0, tokens=prompt)])[0]
        for i, text in enumerate(TEXTS):
            v = pool(s.embed([StageInput(seq=1, pos=0, tokens=_tokens(s, text))])[0], "mean")
            assert abs(float(np.linalg.norm(v)) - 1) < 1e-5
            assert float(v @ want[i]) > 0.998, text
        assert s.n_past(0) == len(prompt) and s.n_past(1) == 0
        s.free(0)
        again = s.forward([StageInput(seq=0, pos=0, tokens=prompt)])[0]
        np.testing.assert_allclose(again, before, atol=1e-4)
        with pytest.raises(StageInputError):
            s.embed([StageInput(seq=0, pos=0, tokens=np.zeros(513, np.int32))])[0]


def test_a_long_input_runs_in_several_decodes_and_equals_one(model_path: Path) -> None:
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    with LlamaStage(model_path, first=True, last=True, n_ctx=512, n_seq_max=1, n_batch=32) as a:
        toks = _tokens(a, text)
        assert len(toks) > 64
        chunked = a.embed([StageInput(seq=0, pos=0, tokens=toks)])[0]
    with LlamaStage(model_path, first=True, last=True, n_ctx=512, n_seq_max=1) as b:
        whole = b.embed([StageInput(seq=0, pos=0, tokens=toks)])[0]
    assert float(pool(chunked, "mean") @ pool(whole, "mean")) > 0.9999


def test_mlx_and_llama_give_the_same_vector(model_path: Path) -> None:
    pytest.importorskip("mlx.core")
    from meshd.engines.mlx_stage import MlxStage

    with (
        LlamaStage(model_path, first=True, last=True, n_ctx=256, n_seq_max=1) as a,
        MlxStage(model_path, start=0, end=30, first=True, last=True, n_ctx=256, n_seq_max=1) as b,
    ):
        for text in TEXTS:
            x = pool(a.embed([StageInput(seq=0, pos=0, tokens=_tokens(a, text))])[0], "mean")
            y = pool(b.embed([StageInput(seq=0, pos=0, tokens=_tokens(a, text))])[0], "mean")
            # llama.cpp's f16 K/V and its CPU attention kernels round otherwise than
            # MLX: 0.9988 and up on these texts (as far as llama-cpp-python's own).
            assert float(x @ y) > 0.998, text


def test_pooling_follows_the_gguf_and_defaults_to_mean(tmp_path: Path, model_path: Path) -> None:
    assert pooling_of(model_path) == "mean"  # a generative model names none
    for value, how in [(1, "mean"), (2, "cls"), (3, "last"), (0, "mean")]:
        p = write_model(tmp_path / f"p{value}.gguf", model_path, "llama",
                        metadata={"llama.pooling_type": value})  # fmt: skip
        assert pooling_of(p) == how
    assert pooling_of(tmp_path) == "mean"  # a folder
    rows = np.array([[3.0, 0.0], [0.0, 4.0], [0.0, 2.0]], np.float32)
    np.testing.assert_allclose(pool(rows, "cls"), [1, 0])
    np.testing.assert_allclose(pool(rows, "last"), [0, 1])
    np.testing.assert_allclose(pool(rows, "mean"), np.array([1, 2]) / np.sqrt(5), rtol=1e-6)
    np.testing.assert_allclose(pool(np.zeros((2, 2), np.float32), "mean"), [0, 0])
    with pytest.raises(ValueError):
        pool(np.zeros((0, 2), np.float32), "mean")


@pytest.mark.parametrize("engine", ["llama", "mlx"])
def test_inputs_embedded_together_equal_each_alone(
    tmp_path: Path, model_path: Path, engine: str
) -> None:
    """Several inputs share decodes (and a context too small for all of them at once
    takes them in groups); each vector is what it would be alone. The grouping, not the
    weights, is under test: a small synthetic model (MLX's CPU backend takes ~0.1 s a
    row of the default model, 30 s for this test)."""
    path = write_model(tmp_path / "synth.gguf", model_path, "llama")
    if engine == "mlx":
        pytest.importorskip("mlx.core")
        from meshd.engines.mlx_stage import MlxStage

        stage = MlxStage(path, start=0, end=N_LAYERS, first=True, last=True, n_ctx=64,
                         n_seq_max=4)  # fmt: skip
    else:
        stage = LlamaStage(path, first=True, last=True, n_ctx=64, n_seq_max=4, n_batch=48)
    texts = [" ".join([t] * 4) for t in TEXTS] + TEXTS
    with stage as s:
        items = [StageInput(seq=0, pos=0, tokens=_tokens(s, t)) for t in texts]
        assert sum(len(it.tokens) for it in items) > 64  # more than one group
        together = s.embed(items)
        for it, rows in zip(items, together, strict=True):
            alone = s.embed([it])[0]
            assert rows.shape == alone.shape
            assert float(pool(rows, "mean") @ pool(alone, "mean")) > 0.9999


@pytest.mark.parametrize(("pooling", "how"), [(1, "mean"), (2, "cls")])
def test_an_encoder_embeds_as_llama_cpp_python_does(
    tmp_path: Path, model_path: Path, pooling: int, how: str
) -> None:
    """A BERT GGUF (non-causal, no output head) is an embedding model: each input whole
    in one decode, pooled the way its GGUF says."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write_bert(tmp_path / "bert.gguf", model_path, pooling=pooling)
    assert pooling_of(path) == how
    ref = llama_cpp.Llama(str(path), embedding=True, verbose=False, n_ctx=512)
    want = np.asarray(ref.embed(TEXTS, normalize=True))
    with LlamaStage(path, first=True, last=True, n_ctx=512, n_seq_max=4) as s:
        assert not s.generative
        items = [StageInput(seq=0, pos=0, tokens=_tokens(s, t)) for t in TEXTS]
        together = s.embed(items)
        for i, rows in enumerate(together):
            v = pool(rows, how)
            assert float(v @ want[i]) > 0.9999, TEXTS[i]
            alone = pool(s.embed([items[i]])[0], how)
            assert float(v @ alone) > 0.99999

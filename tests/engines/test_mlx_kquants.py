"""K-quant (and IQ4_NL) GGUFs on MLX stages, against llama.cpp on the same file.

The model: a 2-layer llama, 256 wide (K-quant rows need widths that are multiples of
256), written in F32 with the default model's tokenizer and quantized by llama.cpp's
own ``llama_model_quantize``. Random weights give near-flat logits whose greedy
choice flips on any rounding, so the output head is made decisive: its row ``j`` is
the embedding of the token before ``j`` in a fixed permutation, and the layers are
small beside the embedding, so each step's top token leads by 13+ logits and greedy
walks the permutation (the layers still move every logit by several units: the
file's own quantization error against F32 is 7-14 here).

What MLX multiplies by (:mod:`meshd.models.gguf_dequant`): Q4_K and Q5_K repacked
exactly; Q6_K (the embedding and head of every file but the Q6_K one, which
``mx.load`` reads whole, Q6_K as f16) re-quantized to 8 bits; Q3_K and IQ4_NL to 6
bits. llama.cpp in exact mode (no flash attention, F32 K/V) still rounds the
activations to int8 blocks before every quantized matmul: that is the ~0.5-0.9 floor
below (the F32 control, where it does not, matches to 4e-5).

Measured, max |logits - llama.cpp whole model's| over 3 prompts x 8 greedy steps and
every logit (top logits 89-95); greedy tokens equal everywhere:

    file      MLX whole   llama.cpp [0,1) -> MLX [1,2)
    Q4_K_M    0.81        0.56
    Q5_K_M    0.89        0.63
    Q6_K      0.88        0.50
    Q3_K_M    1.56        0.75
    IQ4_NL    2.00        0.95
    F32       4e-5        (not run)

At 8 bits instead of 6, Q3_K_M and IQ4_NL come to 0.92 and 0.73 (the floor); at 4
bits to 6.3 and 7.7. ``pytest -s`` prints the figures again.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import mlx.core as mx
import numpy as np
import pytest

from meshd.engines.llama_stage import LlamaStage
from meshd.engines.mlx_stage import MlxStage
from meshd.models.convert import gguf_to_mlx_folder
from meshd.models.errors import UnsupportedModelError
from meshd.models.facts import read_facts
from meshd.models.gguf_dequant import (
    EXACT_BITS,
    REQUANT_BITS,
    TensorInfo,
    load_tensors,
    tensor_infos,
)
from meshd.models.mlx_layout import UnsupportedQuantError, check_gguf_for_mlx
from meshd.models.slicing import slice_gguf
from tests.engines.chains import greedy, worst
from tests.synthetic import _copy_tokenizer

N_LAYERS = 2
HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2
N_CTX = 64
N_GEN = 8
PROMPTS = ("Once upon a time", "The capital of France is", "def fibonacci(n):")

#: llama.cpp file types under test -> the tensor types they must hold (besides F32).
FTYPES = {
    "Q4_K_M": {"Q4_K", "Q6_K"},
    "Q5_K_M": {"Q5_K", "Q6_K"},
    "Q6_K": {"Q6_K"},
    "Q3_K_M": {"Q3_K", "Q4_K", "Q5_K", "Q6_K"},
    "IQ4_NL": {"IQ4_NL", "Q6_K"},
}

#: Bound on max |logits - llama.cpp's| (whole MLX model and mixed chain): measured
#: 0.5-2.0 with logits reaching ~95 (module docstring); a 4-bit re-quantization of
#: Q3_K or IQ4_NL (6.3, 7.7) or a wrong repack would fail it.
LOGIT_TOL = 2.5
#: The F32 control: no activation rounding in llama.cpp, the same weights.
F32_TOL = 3e-4

#: What the tests measured, printed at the end of the module (``pytest -s``).
FIGURES: dict[str, str] = {}

Stage = LlamaStage | MlxStage


def _write_f32_llama(path: Path, tokenizer_from: Path, *, tied: bool = False) -> None:
    """The synthetic F32 model of the module docstring; ``tied``: no output head (the
    embedding is the head, so the current token itself leads and greedy repeats it)."""
    rng = np.random.default_rng(3)
    hd = HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    n_vocab = _copy_tokenizer(w, tokenizer_from)

    def t(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + t(HIDDEN)).astype(np.float32)

    embd = t(n_vocab, HIDDEN, scale=0.5)
    w.add_tensor("token_embd.weight", embd)
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm())
        w.add_tensor(p + "attn_q.weight", t(HEADS * hd, HIDDEN))
        w.add_tensor(p + "attn_k.weight", t(KV_HEADS * hd, HIDDEN))
        w.add_tensor(p + "attn_v.weight", t(KV_HEADS * hd, HIDDEN))
        w.add_tensor(p + "attn_output.weight", t(HIDDEN, HEADS * hd))
        w.add_tensor(p + "ffn_norm.weight", norm())
        w.add_tensor(p + "ffn_gate.weight", t(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", t(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", t(HIDDEN, FFN))
    w.add_tensor("output_norm.weight", norm())
    if not tied:
        # Row j scores the embedding of the token before j in a fixed permutation:
        # the hidden state stays near the current token's embedding, so its
        # successor leads.
        perm = rng.permutation(n_vocab)
        head = np.empty_like(embd)
        head[perm[1:]] = embd[perm[:-1]]
        head[perm[0]] = embd[perm[-1]]
        w.add_tensor("output.weight", head)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quantize(src: Path, dest: Path, ftype_name: str) -> None:
    """``dest``: ``src`` quantized by llama.cpp itself (``llama_model_quantize``)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dest).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize({ftype_name}) returned {rc}"


def _types(path: Path) -> set[str]:
    return {info.type_name for info in tensor_infos(path).values()} - {"F32"}


def _raw(path: Path) -> Iterator[tuple[str, TensorInfo, np.ndarray]]:
    """(name, where it lies, raw bytes) of every tensor (gguf.GGUFReader takes seconds to
    parse the 49k-token vocabulary; this takes milliseconds)."""
    data = np.memmap(path, np.uint8, mode="r")
    for name, info in tensor_infos(path).items():
        yield name, info, info.raw(data)


# -- fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def f32_model(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kquants") / "synthetic-f32.gguf"
    _write_f32_llama(path, model_path)
    return path


@pytest.fixture(scope="module")
def quantized(f32_model: Path) -> dict[str, Path]:
    """Every file type of ``FTYPES``, quantized once for the module."""
    out = {}
    for name in FTYPES:
        out[name] = f32_model.with_name(f"synthetic-{name}.gguf")
        _quantize(f32_model, out[name], name)
    return out


@pytest.fixture(scope="module", autouse=True)
def print_figures() -> Iterator[None]:
    yield
    if FIGURES:
        print("\nK-quant figures (max |logits - llama.cpp whole model|):")
        for label, line in FIGURES.items():
            print(f"  {label}: {line}")


# -- what gets read, and how -------------------------------------------------------


@pytest.mark.timeout(120)
def test_llama_cpp_made_the_types_under_test(quantized: dict[str, Path]) -> None:
    for name, types in FTYPES.items():
        assert _types(quantized[name]) == types, name
        check_gguf_for_mlx(quantized[name])  # no UnsupportedQuantError any more
        facts = read_facts(quantized[name], name, sha256="0" * 64)
        assert facts.engines == ["llama_cpp", "mlx"], name


@pytest.mark.timeout(60)
def test_converting_a_kquant_gguf_to_a_folder_is_refused(
    quantized: dict[str, Path], tmp_path: Path
) -> None:
    """The converter reads the file with mx.load, which gets Q4_K wrong: it refuses."""
    with pytest.raises(UnsupportedModelError, match=r"mx\.load reads whole"):
        gguf_to_mlx_folder(quantized["Q4_K_M"], tmp_path / "out")


@pytest.mark.timeout(120)
def test_exact_types_carry_llama_cpps_values_and_others_add_little_error(
    f32_model: Path, quantized: dict[str, Path]
) -> None:
    """Repacked types give llama.cpp's dequantized values exactly; re-quantized ones
    add well under the file's own error (RMS, against the F32 weights)."""
    source = {name: raw.view(np.float32).reshape(i.shape) for name, i, raw in _raw(f32_model)}
    added: dict[str, float] = {}
    # The files share many tensors byte for byte (each K-quant file's Q6_K head, 10 MB):
    # those give the same values again, so each is checked once (44% of the bytes).
    checked: set[tuple[str, bytes]] = set()
    for path in quantized.values():
        todo: dict[str, tuple[TensorInfo, np.ndarray]] = {}
        for name, info, raw in _raw(path):
            key = (name, hashlib.sha256(raw).digest())
            if info.type_name != "F32" and key not in checked:
                checked.add(key)
                todo[name] = (info, raw)
        mlx = load_tensors(path, todo.__contains__)
        for name, (info, raw) in todo.items():
            kind = info.type_name
            want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
            want = want.reshape(info.shape)
            base = name.removesuffix(".weight")
            packed = mlx[f"{base}.weight"]
            bits = packed.shape[1] * 32 // want.shape[1]
            assert bits == EXACT_BITS.get(kind, REQUANT_BITS.get(kind)), name
            got = mx.dequantize(
                packed, mlx[f"{base}.scales"], mlx[f"{base}.biases"], group_size=32, bits=bits
            )
            err = np.sqrt(np.mean((np.array(got) - want) ** 2))
            if kind in EXACT_BITS:
                assert err == 0.0, (name, kind)
            else:
                own = np.sqrt(np.mean((want - source[name]) ** 2))
                added[kind] = max(added.get(kind, 0.0), float(err / own))
    # Measured: Q6_K 0.27 (8 bits), IQ4_NL 0.24, Q3_K 0.11 (6 bits).
    assert set(added) == {"Q6_K", "Q3_K", "IQ4_NL"}
    assert max(added.values()) < 0.35, added
    FIGURES["re-quantization RMS / file's own RMS error"] = ", ".join(
        f"{k} {v:.3f}" for k, v in sorted(added.items())
    )


@pytest.mark.timeout(60)
def test_q4_1_repacks_bit_for_bit_like_mx_load(model_path: Path) -> None:
    """The default model's Q4_1 tensors read through gguf-py equal mx.load's."""
    names = {"blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"}
    ours = load_tensors(model_path, lambda n: n in names)
    theirs = mx.load(str(model_path))
    assert len(ours) == 3 * len(names)
    for key, arr in ours.items():
        assert mx.array_equal(arr, theirs[key].astype(arr.dtype)), key


@pytest.mark.timeout(30)
@pytest.mark.parametrize("qtype", ["Q1_0", "Q8_K"])
def test_types_gguf_py_cannot_read_are_not_offered_to_mlx(tmp_path: Path, qtype: str) -> None:
    """Placement's facts leave MLX out (the header check itself: test_mlx_stage)."""
    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    path = tmp_path / f"{qtype}.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_tensor("token_embd.weight", np.zeros((16, 256), np.float32))
    w.add_tensor(
        "blk.0.attn_q.weight", np.zeros((1, 256 // block * size), np.uint8), raw_dtype=kind
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedQuantError) as err:
        check_gguf_for_mlx(path)
    assert err.value.types == [qtype] and "blk.0.attn_q.weight" in str(err.value)
    assert "mlx" not in read_facts(path, qtype, sha256="0" * 64).engines


# -- against llama.cpp -------------------------------------------------------------


def _compare(path: Path, slice_dir: Path, label: str, tol: float, *, mixed: bool = True) -> None:
    """Greedy tokens of the MLX whole model and (``mixed``) of llama.cpp [0,1) ->
    MLX [1,2) equal llama.cpp's whole model on every prompt, logits within ``tol``."""
    kw: dict[str, Any] = {"n_ctx": N_CTX, "n_seq_max": 1}
    stages: list[Stage] = []
    try:
        reference = LlamaStage(path, first=True, last=True, exact=True, n_threads=1, **kw)
        stages.append(reference)
        t0 = time.perf_counter()
        stages.append(MlxStage(path, start=0, end=N_LAYERS, first=True, last=True, **kw))
        load_s = time.perf_counter() - t0
        chains: dict[str, list[Stage]] = {"mlx": stages[1:2]}
        if mixed:
            lo = slice_gguf(path, 0, 1, slice_dir, hashlib.sha256(label.encode()).hexdigest())
            stages.append(LlamaStage(lo, first=True, last=False, exact=True, n_threads=1, **kw))
            stages.append(MlxStage(path, start=1, end=N_LAYERS, first=False, last=True, **kw))
            chains["llama->mlx"] = stages[2:4]
        worst_of = dict.fromkeys(chains, 0.0)
        top, margin = 0.0, np.inf
        for text in PROMPTS:
            prompt = reference.tokenize(text, add_special=False, parse_special=True)
            want, want_logits = greedy([reference], prompt, N_GEN)
            top = max(top, *(float(x.max()) for x in want_logits))
            # The model is decisive: llama.cpp's top token leads by far more than tol.
            margin = min(margin, *(float(np.diff(np.sort(x)[-2:])[0]) for x in want_logits))
            assert margin > 2 * tol, (label, text, margin)
            for name, chain in chains.items():
                tokens, logits = greedy(chain, prompt, N_GEN)
                assert tokens == want, (label, name, text)
                worst_of[name] = max(worst_of[name], worst(logits, want_logits))
        FIGURES[label] = (
            ", ".join(f"{name} {w:.3g}" for name, w in worst_of.items())
            + f" (top logit {top:.0f}, least lead {margin:.1f}; MLX load {load_s:.2f} s)"
        )
        assert max(worst_of.values()) <= tol, (label, worst_of)
    finally:
        for s in stages:
            s.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ftype", list(FTYPES))
def test_kquant_gguf_gives_llama_cpps_greedy_tokens_on_mlx_and_mixed(
    quantized: dict[str, Path], slice_dir: Path, ftype: str
) -> None:
    _compare(quantized[ftype], slice_dir, ftype, LOGIT_TOL)


@pytest.mark.timeout(120)
def test_tied_kquant_model_uses_its_quantized_embedding_as_the_head(
    model_path: Path, tmp_path: Path, slice_dir: Path
) -> None:
    """No output.weight: llama.cpp makes the embedding Q6_K, which MLX re-quantizes to
    8 bits and runs as the embedding on the first stage and as the head (``as_linear``
    of a quantized embedding) on the last."""
    f32 = tmp_path / "tied-f32.gguf"
    _write_f32_llama(f32, model_path, tied=True)
    path = tmp_path / "tied-Q4_K_M.gguf"
    _quantize(f32, path, "Q4_K_M")
    infos = tensor_infos(path)
    assert "output.weight" not in infos and infos["token_embd.weight"].type_name == "Q6_K"
    _compare(path, slice_dir, "Q4_K_M tied", LOGIT_TOL)


@pytest.mark.timeout(120)
def test_f32_control_matches_llama_cpp_to_1e_4(f32_model: Path, slice_dir: Path) -> None:
    """The same model unquantized: what is left is float32 rounding, so the K-quant
    differences above are llama.cpp's activation rounding and the re-quantization."""
    _compare(f32_model, slice_dir, "F32", F32_TOL, mixed=False)

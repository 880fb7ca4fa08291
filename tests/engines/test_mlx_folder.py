"""MLX model folders: a folder written from the default GGUF, run by mlx-lm and MlxStage.

The folder is built once per module (``gguf_to_mlx_folder``: MLX's quantized layout,
Q/K rows back in Hugging Face's rope order, a tokenizer.json from the GGUF vocabulary)
and then held to three references: plain ``mlx_lm.load`` + greedy generation, the
MLX stage on the GGUF itself, and llama.cpp's vocabulary.

Measured on SmolLM2-135M Q4_1: folder stage vs GGUF stage logits differ by ~8e-5
(the same weights; rope on half-split rows instead of interleaved pairs changes the
order of the attention sums), tokens identical; a 2-stage split of the folder matches
its whole model exactly.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshd.engines.llama_stage import LlamaVocab
from meshd.engines.mlx_stage import MlxStage
from meshd.engines.stage import StageInput
from meshd.models.chat import chat_template_at
from meshd.models.convert import gguf_to_mlx_folder
from meshd.models.errors import ModelFormatError, UnsupportedModelError
from meshd.models.facts import read_facts
from meshd.models.folder import (
    check_folder_for_mlx,
    folder_sha256,
    inspect_folder,
    is_mlx_folder,
    read_folder_facts,
)
from meshd.models.vocab import HfVocab
from tests.engines.chains import greedy, worst

N_CTX = 128
N_GEN = 12
PROMPT = "Once upon a time"
#: Folder vs GGUF stage: the same float32 weights, attention sums in another order.
FOLDER_TOL = 1e-3
#: Split vs whole folder model: the same operations on the same rows.
CHAIN_TOL = 1e-5

TEXTS = [
    "Once upon a time",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "Überraschung! Ein Café in Zürich, señor",
    "emoji 🙂👍🏽 and a family 👨‍👩‍👧",
    "日本語のテキストと中文文本",
    "12345 3.14159 1,000,000 ²½ ٣٤",
    "don't won't I'm you'll",
    "def f(x):\n    return x**2  # squared",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><reponame>x<file_sep>y",
    "a<|im_start|>b",
    "",
    " ",
]


# -- fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gguf_to_mlx_folder(model_path, tmp_path_factory.mktemp("mlx") / "smollm2-mlx")


@pytest.fixture(scope="module")
def folder_whole(folder: Path) -> Iterator[MlxStage]:
    with MlxStage(folder, start=0, end=30, first=True, last=True, n_ctx=N_CTX, n_seq_max=1) as s:
        yield s


@pytest.fixture(scope="module")
def prompt(model_path: Path) -> list[int]:
    vocab = LlamaVocab.load(model_path)
    try:
        return vocab.tokenize(PROMPT, True, True)
    finally:
        vocab.close()


@pytest.fixture(scope="module")
def folder_run(folder_whole: MlxStage, prompt: list[int]):
    return greedy([folder_whole], prompt, N_GEN)


def _tiny_folder(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    import mlx.core as mx

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()}
    )
    return path


_TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-5,
    "vocab_size": 16,
}


# -- the folder itself -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_folder_layout_facts_and_template(folder: Path, model_path: Path, tmp_path: Path) -> None:
    assert is_mlx_folder(folder) and not is_mlx_folder(model_path)
    assert not is_mlx_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    # Q4_1 layers; SmolLM2's embedding is Q8_0 in this GGUF: a per-module entry.
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    check_folder_for_mlx(folder)

    g = read_facts(model_path, "gguf")
    f = read_folder_facts(folder, "folder")
    assert (f.format, f.architecture, f.engines) == ("mlx", "llama", ["mlx"])
    assert (f.n_layers, f.hidden_size, f.n_ctx_train) == (g.n_layers, g.hidden_size, 8192)
    assert f.n_ctx_train == g.n_ctx_train
    # MLX affine 4-bit (f16 scale + bias per 32) is Q4_1's size exactly; the 8-bit
    # embedding carries a bias Q8_0 lacks (36 vs 34 bytes per 32 values).
    for fb, gb in zip(f.layer_bytes, g.layer_bytes, strict=True):
        assert 0.9 <= fb / gb <= 1.1
    assert 1.0 <= f.embed_bytes / g.embed_bytes <= 1.1
    assert f.head_bytes == g.head_bytes  # tied: the final norm only
    assert f.quant_types == ["F32", "mlx-q4", "mlx-q8"]
    # The same weights: as many parameters, though packed another way.
    assert f.n_params == g.n_params and f.parameter_size == "135M"
    # float32 K and V in the MLX stage: 2 * 3 KV heads * 64 dims * 4 bytes.
    assert f.kv_bytes_per_token_layer == 2 * 3 * 64 * 4
    assert chat_template_at(model_path) == chat_template_at(folder)

    # The content id: stable, cached, and it moves with the config.
    cache = tmp_path / "cache"
    assert f.sha256 == folder_sha256(folder, cache) == folder_sha256(folder, cache)
    other = tmp_path / "other"
    other.mkdir()
    for p in folder.iterdir():
        (other / p.name).symlink_to(p)
    assert folder_sha256(other) == f.sha256
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": 1e4}))
    assert folder_sha256(other) != f.sha256


@pytest.mark.timeout(60)
def test_hf_vocab_matches_llama_vocab(folder: Path, model_path: Path) -> None:
    hv = HfVocab.load(folder)
    lv = LlamaVocab.load(model_path)
    try:
        assert hv.n_vocab == lv.n_vocab == 49152
        for text in TEXTS:
            for add_special in (False, True):
                for parse_special in (False, True):
                    assert hv.tokenize(text, add_special, parse_special) == lv.tokenize(
                        text, add_special, parse_special
                    ), (text, add_special, parse_special)
        # Special-token text is text unless parse_special says otherwise.
        chat = "<|im_start|>user"
        assert hv.tokenize(chat, False, True)[0] == 1
        assert 1 not in hv.tokenize(chat, False, False)
        # Every token's bytes, special or not (byte-level pieces may be part of a
        # UTF-8 character: 🙂 is four tokens' worth of bytes in this vocabulary).
        for tok in range(lv.n_vocab):
            for special in (False, True):
                assert hv.token_to_piece(tok, special) == lv.token_to_piece(tok, special), tok
        assert hv.token_to_piece(2) == b"" and hv.token_to_piece(2, True) == b"<|im_end|>"
        # eos <|im_end|>, plus what llama.cpp calls end-of-generation by its text.
        assert hv.eos_tokens() == lv.eos_tokens() == {0, 2, 4}
    finally:
        hv.close()
        lv.close()


# -- running it ---------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_mlx_lm_load_and_the_gguf_stage_give_the_folder_stages_tokens(
    folder: Path, model_path: Path, prompt: list[int], folder_run, folder_whole: MlxStage
) -> None:
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    tokens, logits = folder_run
    assert folder_whole.tokenize(PROMPT, True, True) == prompt
    assert tokens[:4] == [28, 260, 2240, 282]  # ", the city of" (ENGINE-NOTES)

    model, tokenizer = load(str(folder))
    assert tokenizer.encode(PROMPT) == prompt
    ref = [
        r.token
        for r in stream_generate(
            model, tokenizer, mx.array(prompt), max_tokens=N_GEN, sampler=make_sampler(temp=0.0)
        )
    ]
    assert ref == tokens
    del model

    with MlxStage(
        model_path, start=0, end=30, first=True, last=True, n_ctx=N_CTX, n_seq_max=1
    ) as gguf_whole:
        g_tokens, g_logits = greedy([gguf_whole], prompt, N_GEN)
    assert g_tokens == tokens
    assert worst(g_logits, logits) <= FOLDER_TOL


@pytest.mark.timeout(60)
def test_two_stage_split_matches_the_whole_folder_model(
    folder: Path, prompt: list[int], folder_run
) -> None:
    from mlx.utils import tree_flatten

    s0 = MlxStage(folder, start=0, end=15, first=True, last=False, n_ctx=N_CTX, n_seq_max=1)
    s1 = MlxStage(folder, start=15, end=30, first=False, last=True, n_ctx=N_CTX, n_seq_max=1)
    with s0, s1:
        assert (s0.n_layers, s1.n_layers, s0.hidden_size) == (15, 15, 576)
        # Stage 1 is last with a tied head: it loads the embedding to use as its head.
        p0 = dict(tree_flatten(s0.mlx_model.parameters()))
        p1 = dict(tree_flatten(s1.mlx_model.parameters()))
        assert "model.layers.14.self_attn.q_proj.scales" in p0
        assert "model.embed_tokens.scales" in p0 and "model.embed_tokens.scales" in p1
        tokens, logits = greedy([s0, s1], prompt, N_GEN)
    assert tokens == folder_run[0]
    assert worst(logits, folder_run[1]) <= CHAIN_TOL


@pytest.mark.timeout(60)
def test_middle_stage_reads_only_its_layers(folder: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    with MlxStage(folder, start=10, end=13, first=False, last=False, n_ctx=8, n_seq_max=1) as s:
        params = dict(tree_flatten(s.mlx_model.parameters()))
        assert "model.layers.2.mlp.down_proj.scales" in params
        assert "model.layers.3.mlp.down_proj.scales" not in params
        # The embedding was never quantized (its tensors were not loaded).
        assert "model.embed_tokens.scales" not in params
        # Scales are cast to float32 on the CPU, as for a GGUF.
        assert params["model.layers.0.self_attn.q_proj.scales"].dtype == mx.float32
        out = s.forward([StageInput(seq=0, pos=0, hidden=np.ones((3, 576), np.float32))])[0]
        assert out.shape == (3, 576) and np.isfinite(out).all()


# -- refusals -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_unsupported_folders_are_refused_by_name(tmp_path: Path) -> None:
    f32 = np.zeros((16, 32), np.float32)
    olmo = _tiny_folder(
        tmp_path / "olmo", {**_TINY, "model_type": "olmo2"}, {"model.embed_tokens.weight": f32}
    )
    with pytest.raises(UnsupportedModelError, match=r"olmo2.*supported: .*qwen3"):
        check_folder_for_mlx(olmo)
    with pytest.raises(UnsupportedModelError, match="olmo2"):
        MlxStage(olmo, start=0, end=1, first=True, last=True, n_ctx=8, n_seq_max=1)
    # Facts still read (sizes), but no engine is offered.
    facts = read_folder_facts(olmo, "olmo")
    assert facts.engines == [] and facts.architecture == "olmo2"

    awq = _tiny_folder(
        tmp_path / "awq",
        {**_TINY, "quantization_config": {"quant_method": "awq"}},
        {"model.embed_tokens.weight": f32},
    )
    with pytest.raises(UnsupportedModelError, match="awq"):
        check_folder_for_mlx(awq)
    qknorm = _tiny_folder(
        tmp_path / "qknorm",
        _TINY,
        {"model.embed_tokens.weight": f32, "model.layers.0.self_attn.q_norm.weight": f32[0]},
    )
    with pytest.raises(UnsupportedModelError, match="q_norm"):
        check_folder_for_mlx(qknorm)
    # mlx-lm's qwen3 model has no sliding layers (llama's and Gemma 3's have).
    swa = _tiny_folder(
        tmp_path / "swa",
        {**_TINY, "model_type": "qwen3", "layer_types": ["sliding_attention"]},
        {"model.embed_tokens.weight": f32},
    )
    with pytest.raises(UnsupportedModelError, match="sliding"):
        check_folder_for_mlx(swa)

    no_weights = tmp_path / "empty"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(_TINY))
    with pytest.raises(ModelFormatError):
        check_folder_for_mlx(no_weights)
    with pytest.raises(FileNotFoundError):
        check_folder_for_mlx(tmp_path / "missing")


@pytest.mark.timeout(30)
def test_a_folder_without_tokenizer_or_with_short_embedding_is_refused(
    folder: Path, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(folder / name)
    assert inspect_folder(bare).n_layers == 30
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        MlxStage(bare, start=0, end=1, first=True, last=False, n_ctx=8, n_seq_max=1)
    # A tokenizer with more ids than the embedding has rows.
    shutil.copy(folder / "tokenizer.json", bare / "tokenizer.json")
    tiny = _tiny_folder(
        tmp_path / "tiny", _TINY, {"model.embed_tokens.weight": np.zeros((16, 32), np.float32)}
    )
    shutil.copy(folder / "tokenizer.json", tiny / "tokenizer.json")
    with pytest.raises(ModelFormatError, match="rows"):
        MlxStage(tiny, start=0, end=1, first=True, last=False, n_ctx=8, n_seq_max=1)

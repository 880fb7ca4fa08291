"""MLX stages of other architectures: each runs mlx-lm's own model of its ``model_type``
and, whole or cut in two or three, gives what mlx-lm's whole model gives.

The folders are written here: config.json, seeded random float32 weights in mlx-lm's
(Hugging Face's) names, and a tokenizer.json built from the default model's
vocabulary (its first 2,048 tokens and the merges among them: every stage loads its
tokenizer, 0.3 s for all 49,152), so no download is needed and every tensor shape is
the architecture's own. Gemma 3 gets a window of 4 with every second layer sliding,
and every prompt is longer than that, so its windowed layers, their pattern by
absolute layer index and its scaled embedding all count: a stage that got any of them
wrong fails.

Measured (float32, CPU), stage chains (whole, 2 and 3 stages) vs mlx-lm's whole model,
max |dlogits|: 0 for llama, mistral, qwen2, qwen3 and phi3; ~3e-5 for Gemma 3 and ~4e-6
for the sliding llama (mlx-lm's rotating caches attend over fewer keys, in another
order, where the stage slices a plain cache); greedy tokens the same everywhere. Several
requests batched in one forward call (the ragged block of every architecture here,
windowed layers included) vs each alone through the same chain: 0.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshd.domain.builds import MLX_BATCHED_ARCHITECTURES
from meshd.engines.mlx_stage import MlxStage
from meshd.engines.stage import StageInput
from meshd.models.errors import UnsupportedModelError
from meshd.models.folder import check_folder_for_mlx, folder_sha256, read_folder_facts
from meshd.models.folder_slicing import slice_folder, unpack_folder_slice
from meshd.placement import SPLIT_PROVEN

pytestmark = pytest.mark.timeout(120)

N_LAYERS = 4
N_VOCAB = 2048
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 128
WINDOW = 4
N_GEN = 5
#: Stage chains vs mlx-lm's whole model: the same operations on float32 rows.
TOL = 1e-4
#: The same stage's numbers from another order of requests or a rebuilt cache.
SAME = 1e-5
PROMPT = "Once upon a time, in a land far away, there lived a small dragon"

_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": N_LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}

#: Per architecture: config.json entries past the common ones, and its layers' modules
#: (name -> shape) besides the norms every block has.
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": True},
    # A llama with sliding-window layers (layer_types), run by the same stage.
    "llama_swa": {
        "model_type": "llama",
        "tie_word_embeddings": False,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * (N_LAYERS // 2),
    },
    "mistral": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": False},
    "gemma3_text": {
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": HEAD_DIM,
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1000000.0,
    },
    "phi3": {"tie_word_embeddings": False},
}
#: Image-text Gemma 3: the gemma3_text model above as its text_config, its tensors under
#: ``language_model.``, beside a vision tower's (never loaded).
ARCHS["gemma3"] = {**ARCHS["gemma3_text"], "model_type": "gemma3_text"}


def _layer_shapes(arch: str) -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    norms = {"input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,)}
    if arch == "phi3":
        return {
            **norms,
            "self_attn.qkv_proj.weight": (q + 2 * kv, HIDDEN),
            "self_attn.o_proj.weight": (HIDDEN, q),
            "mlp.gate_up_proj.weight": (2 * FFN, HIDDEN),
            "mlp.down_proj.weight": (HIDDEN, FFN),
        }
    shapes = {
        **norms,
        "self_attn.q_proj.weight": (q, HIDDEN),
        "self_attn.k_proj.weight": (kv, HIDDEN),
        "self_attn.v_proj.weight": (kv, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, q),
        "mlp.gate_proj.weight": (FFN, HIDDEN),
        "mlp.up_proj.weight": (FFN, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, FFN),
    }
    if arch == "qwen2":
        shapes.update(
            {f"self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))}
        )
    if arch in ("qwen3", "gemma3_text"):
        shapes.update(
            {"self_attn.q_norm.weight": (HEAD_DIM,), "self_attn.k_norm.weight": (HEAD_DIM,)}
        )
    if arch == "gemma3_text":
        shapes.update(
            {
                "pre_feedforward_layernorm.weight": (HIDDEN,),
                "post_feedforward_layernorm.weight": (HIDDEN,),
            }
        )
    return shapes


def write_folder(path: Path, arch: str, tokenizer: Path, n_vocab: int) -> Path:
    """A 4-layer folder of ``arch`` with seeded random float32 weights."""
    import mlx.core as mx

    rng = np.random.default_rng(11)
    extra = ARCHS[arch]
    model_type = extra.get("model_type", arch)
    config = {"model_type": model_type, **_COMMON, **extra, "vocab_size": n_vocab}
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.normal(0, 1.0, (n_vocab, HIDDEN)),
        "model.norm.weight": 1 + rng.normal(0, 0.1, HIDDEN),
    }
    tied = config.get("tie_word_embeddings", True)
    if model_type == "gemma3_text":
        tied = True  # Gemma's checkpoints hold no lm_head: mlx-lm ties it (sanitize)
        config.pop("tie_word_embeddings", None)
    if not tied:
        tensors["lm_head.weight"] = rng.normal(0, 0.2, (n_vocab, HIDDEN))
    for i in range(N_LAYERS):
        for name, shape in _layer_shapes(model_type).items():
            if "norm" in name:
                value = (0.0 if model_type == "gemma3_text" else 1.0) + rng.normal(0, 0.1, shape)
            else:
                value = rng.normal(0, 0.3 if name.endswith("bias") else 0.15, shape)
            tensors[f"model.layers.{i}.{name}"] = value
    if arch == "gemma3":
        config = {"model_type": "gemma3", "vocab_size": n_vocab, "text_config": config}
        tensors = {f"language_model.{k}": v for k, v in tensors.items()}
        tensors["vision_tower.patch_embedding.weight"] = rng.normal(0, 1, (8, 3, 2, 2))
        tensors["multi_modal_projector.mm_input_projection_weight"] = rng.normal(0, 1, (8, 8))
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(path / "model.safetensors"),
        {k: mx.array(v.astype(np.float32)) for k, v in tensors.items()},
    )
    for f in tokenizer.iterdir():
        (path / f.name).symlink_to(f)
    return path


# -- fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """tokenizer.json + tokenizer_config.json of the default model's first ``N_VOCAB``
    tokens (byte-level BPE: ids follow the merges' order, so the merges whose parts and
    result are all kept give the same tokenizer over a smaller vocabulary)."""
    import mlx.core as mx

    from meshd.models.convert import _gguf_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    _, md = mx.load(str(model_path), return_metadata=True)
    tokens = md["tokenizer.ggml.tokens"][:N_VOCAB]
    kept = set(tokens)
    md["tokenizer.ggml.tokens"] = tokens
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:N_VOCAB]
    md["tokenizer.ggml.merges"] = [
        m for m in md["tokenizer.ggml.merges"] if {*m.split(" "), m.replace(" ", "")} <= kept
    ]
    tok, cfg = _gguf_tokenizer(md, model_path)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out, len(md["tokenizer.ggml.tokens"])


@pytest.fixture(scope="module", params=sorted(ARCHS))
def folder(request: pytest.FixtureRequest, tokenizer: tuple[Path, int], tmp_path_factory) -> Path:
    tok_dir, n_vocab = tokenizer
    return write_folder(
        tmp_path_factory.mktemp("arch") / request.param, request.param, tok_dir, n_vocab
    )


def _stage(path: Path, start: int, end: int, n_seq_max: int = 3) -> MlxStage:
    return MlxStage(
        path,
        start=start,
        end=end,
        first=start == 0,
        last=end == N_LAYERS,
        n_ctx=128,
        n_seq_max=n_seq_max,
        exact=True,
    )


@pytest.fixture(scope="module")
def chains(folder: Path) -> Iterator[dict[str, list[MlxStage]]]:
    """The folder's model whole, cut at 1, and cut at 1 and 3 (the last two share their
    stage of layer 0: no test runs both at once)."""
    cuts = {"whole": [0, N_LAYERS], "two": [0, 1, N_LAYERS], "three": [0, 1, 3, N_LAYERS]}
    stages: dict[tuple[int, int], MlxStage] = {}

    def stage(a: int, b: int) -> MlxStage:
        if (a, b) not in stages:
            stages[a, b] = _stage(folder, a, b)
        return stages[a, b]

    yield {name: [stage(a, b) for a, b in itertools.pairwise(c)] for name, c in cuts.items()}
    for s in stages.values():
        s.close()


@pytest.fixture(scope="module")
def prompt(chains: dict[str, list[MlxStage]]) -> list[int]:
    ids = chains["whole"][0].tokenize(PROMPT, False, False)
    assert len(ids) > 2 * WINDOW
    return ids


@pytest.fixture(scope="module")
def reference(folder: Path, prompt: list[int]) -> tuple[list[int], list[np.ndarray], np.ndarray]:
    return mlx_lm_run(folder, prompt)


def mlx_lm_run(folder: Path, prompt: list[int]) -> tuple[list[int], list[np.ndarray], np.ndarray]:
    """mlx-lm's whole model on the folder (its own caches: rotating for Gemma's sliding
    layers): greedy tokens, each step's logits, and every prompt row's logits."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    cache = model.make_cache() if hasattr(model, "make_cache") else None
    if cache is None:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
    rows = model(mx.array([prompt]), cache=cache)
    mx.eval(rows)
    all_rows = np.array(rows[0], dtype=np.float32)
    tokens, logits = [], [all_rows[-1]]
    for _ in range(N_GEN):
        tokens.append(int(np.argmax(logits[-1])))
        if len(tokens) == N_GEN:
            break
        step = model(mx.array([[tokens[-1]]]), cache=cache)
        logits.append(np.array(step[0, -1], dtype=np.float32))
    return tokens, logits, all_rows


def _step(chain: Sequence[MlxStage], seq: int, pos: int, tokens: Sequence[int], n_logits: int = 1):
    x = chain[0].forward(
        [StageInput(seq=seq, pos=pos, tokens=np.asarray(tokens, np.int32), n_logits=n_logits)]
    )[0]
    for stage in chain[1:]:
        x = stage.forward([StageInput(seq=seq, pos=pos, hidden=x, n_logits=n_logits)])[0]
    return x


def greedy(chain: Sequence[MlxStage], prompt: Sequence[int], seq: int = 0):
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    pos, cur = 0, list(prompt)
    try:
        for _ in range(N_GEN):
            x = _step(chain, seq, pos, cur)
            assert x.shape == (chain[-1].n_vocab,) and x.dtype == np.float32
            pos += len(cur)
            logits.append(x)
            tokens.append(int(np.argmax(x)))
            cur = [tokens[-1]]
    finally:
        for stage in chain:
            stage.free(seq)
    return tokens, logits


def worst(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True)
    )


# -- the tests ---------------------------------------------------------------------


def test_the_split_allowlist_is_what_this_matrix_proves() -> None:
    # Placement cuts a folder only of a type proven here (whole vs 2 and 3 stages); an
    # image-text gemma3 folder's facts name its text model, gemma3_text.
    assert SPLIT_PROVEN["mlx"] == {extra.get("model_type", a) for a, extra in ARCHS.items()}


def test_stage_runs_the_architectures_own_model(
    folder: Path, chains: dict[str, list[MlxStage]]
) -> None:
    from mlx_lm.utils import _get_classes

    config = json.loads((folder / "config.json").read_text())
    # An image-text Gemma 3 runs its text model: mlx-lm's gemma3 model wraps it.
    model_class, _ = _get_classes(config.get("text_config") or config)
    for chain in chains.values():
        for stage in chain:
            model = stage.mlx_model
            assert type(model) is model_class
            # Only the stage's layers are kept, renumbered from 0.
            assert len(model.model.layers) == stage.n_layers
            # Requests run together (ragged) where the rule says, windowed layers too.
            assert stage.batched == (config["model_type"] in MLX_BATCHED_ARCHITECTURES)
    facts = read_folder_facts(folder, "x")
    assert facts.engines == ["mlx"] and facts.n_layers == N_LAYERS


@pytest.mark.parametrize("cut", ["whole", "two", "three"])
def test_chain_gives_mlx_lms_whole_model(
    chains: dict[str, list[MlxStage]], prompt: list[int], reference, cut: str
) -> None:
    ref_tokens, ref_logits, _ = reference
    tokens, logits = greedy(chains[cut], prompt)
    assert tokens == ref_tokens
    assert worst(logits, ref_logits) < TOL


def test_interleaved_requests_and_several_logit_rows(
    chains: dict[str, list[MlxStage]], prompt: list[int], reference
) -> None:
    """Two requests in one forward call (prefill, then decode together), one of them
    asking for the logits of its last 3 rows; each gets what it gets alone."""
    ref_tokens, ref_logits, all_rows = reference
    other = prompt[::-1][:9]
    alone_tokens, alone_logits = greedy(chains["whole"], other)
    chain = chains["three"]
    try:
        items = [
            StageInput(seq=0, pos=0, tokens=np.asarray(prompt, np.int32), n_logits=3),
            StageInput(seq=1, pos=0, tokens=np.asarray(other, np.int32)),
        ]
        xs = chain[0].forward(items)
        for stage in chain[1:]:
            xs = stage.forward(
                [
                    StageInput(seq=it.seq, pos=it.pos, hidden=x, n_logits=it.n_logits)
                    for it, x in zip(items, xs, strict=True)
                ]
            )
        assert xs[0].shape == (3, chain[-1].n_vocab)
        assert float(np.abs(xs[0] - all_rows[-3:]).max()) < TOL
        got = [[xs[0][-1]], [xs[1]]]
        toks = [[int(np.argmax(xs[0][-1]))], [int(np.argmax(xs[1]))]]
        pos = [len(prompt), len(other)]
        for _ in range(N_GEN - 1):
            items = [
                StageInput(seq=k, pos=pos[k], tokens=np.array([toks[k][-1]], np.int32))
                for k in (0, 1)
            ]
            xs = chain[0].forward(items)
            for stage in chain[1:]:
                xs = stage.forward(
                    [StageInput(seq=k, pos=pos[k], hidden=x) for k, x in enumerate(xs)]
                )
            for k in (0, 1):
                got[k].append(xs[k])
                toks[k].append(int(np.argmax(xs[k])))
                pos[k] += 1
    finally:
        for stage in chain:
            stage.free(0)
            stage.free(1)
    assert toks == [ref_tokens, alone_tokens]
    assert worst(got[0], ref_logits) < TOL
    assert worst(got[1], alone_logits) < SAME


def _forward(chain: Sequence[MlxStage], items: list[StageInput]) -> list[np.ndarray]:
    """``items`` (token inputs) through every stage of ``chain`` in one call a stage."""
    xs = chain[0].forward(items)
    for stage in chain[1:]:
        xs = stage.forward(
            [StageInput(seq=it.seq, pos=it.pos, hidden=x) for it, x in zip(items, xs, strict=True)]
        )
    return xs


@pytest.mark.parametrize("cut", ["whole", "two"])
def test_requests_batched_give_what_each_gives_alone(
    chains: dict[str, list[MlxStage]], prompt: list[int], cut: str
) -> None:
    """Three requests in one forward call a step (the ragged batch: one block for all
    of them), the third joining a step late so its prompt shares a call with the
    others' decodes; prompts longer and shorter than the window, so each request's
    windowed layers mask from its own offset. Each gets exactly the tokens and logits
    it gets alone (measured: 0 difference on the CPU, every architecture)."""
    chain = chains[cut]
    prompts = [prompt, prompt[:3], prompt[::-1][: WINDOW + 3]]
    alone = [greedy(chain, p) for p in prompts]
    cur, pos = [list(p) for p in prompts], [0, 0, 0]
    got: list[list[np.ndarray]] = [[], [], []]
    try:
        for step in range(N_GEN + 1):
            ks = [k for k in range(3) if len(got[k]) < N_GEN and (k < 2 or step > 0)]
            items = [StageInput(seq=k, pos=pos[k], tokens=np.asarray(cur[k], np.int32)) for k in ks]
            for k, x in zip(ks, _forward(chain, items), strict=True):
                got[k].append(x)
                pos[k] += len(cur[k])
                cur[k] = [int(np.argmax(x))]
    finally:
        for stage in chain:
            for k in range(3):
                stage.free(k)
    for k in range(3):
        assert [int(np.argmax(x)) for x in got[k]] == alone[k][0]
        assert worst(got[k], alone[k][1]) == 0.0


def test_truncate_and_share_give_the_same_continuation(
    chains: dict[str, list[MlxStage]], prompt: list[int], reference
) -> None:
    """Rolled back past the window (as speculation and prefix reuse do) and run again,
    or shared into another sequence, a request computes what it did the first time."""
    ref_tokens, ref_logits, _ = reference
    chain = chains["two"]
    seq_tokens = prompt + ref_tokens[:3]
    try:
        _step(chain, 0, 0, seq_tokens)
        keep = len(prompt) - WINDOW - 2  # past the window: rotating caches lost these
        for stage in chain:
            stage.truncate(0, keep)
            assert stage.n_past(0) == keep
        again = _step(chain, 0, keep, seq_tokens[keep:])
        for stage in chain:
            stage.share(0, 1, keep)
        shared = _step(chain, 1, keep, seq_tokens[keep:])
    finally:
        for stage in chain:
            stage.free(0)
            stage.free(1)
    assert float(np.abs(again - ref_logits[3]).max()) < TOL
    assert float(np.abs(shared - again).max()) < SAME


def test_an_mlx_quantized_folder_gives_mlx_lms_whole_model(
    folder: Path, tmp_path: Path, prompt: list[int]
) -> None:
    """The folder quantized as mlx-lm does it (4 bits, group 32, embedding included),
    run whole and in three stages."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    nn.quantize(model, group_size=32, bits=4)
    q4 = tmp_path / "q4"
    q4.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (q4 / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(q4 / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for f in folder.iterdir():
        if f.name.startswith("tokenizer"):
            (q4 / f.name).symlink_to(f.resolve())
    ref_tokens, ref_logits, _ = mlx_lm_run(q4, prompt)
    for cuts in ([0, N_LAYERS], [0, 1, 3, N_LAYERS]):
        chain = [_stage(q4, a, b) for a, b in itertools.pairwise(cuts)]
        try:
            assert "scales" in str(tree_flatten(chain[-1].mlx_model.parameters()))
            tokens, logits = greedy(chain, prompt)
        finally:
            for stage in chain:
                stage.close()
        assert tokens == ref_tokens
        assert worst(logits, ref_logits) < TOL


def test_embed_gives_the_models_normed_rows(
    folder: Path, chains: dict[str, list[MlxStage]], prompt: list[int]
) -> None:
    """``embed`` (the embeddings API) runs the same layers: every row after the final
    norm, as mlx-lm's inner model returns them."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    inner = model.language_model.model if hasattr(model, "language_model") else model.model
    want = np.array(inner(mx.array([prompt]))[0], dtype=np.float32)
    got = chains["whole"][0].embed([StageInput(seq=0, pos=0, tokens=np.asarray(prompt, np.int32))])
    assert got[0].shape == want.shape
    assert float(np.abs(got[0] - want).max()) < TOL


def test_a_folder_slice_keeps_its_layers_indices(
    folder: Path, tmp_path: Path, prompt: list[int]
) -> None:
    """Layers [1, 3) cut out as a folder of their own run as layers 1 and 2 of the
    whole model (Gemma's pattern: layer 1 is global, layer 2 sliding), not as 0, 1."""
    sha = folder_sha256(folder)
    archive = slice_folder(folder, 1, 3, tmp_path / "slices", sha)
    sliced = unpack_folder_slice(archive, tmp_path / "sliced")
    check_folder_for_mlx(sliced)
    rows = np.random.default_rng(3).normal(0, 1, (len(prompt), HIDDEN)).astype(np.float32)
    with (
        _stage(folder, 1, 3) as whole,
        MlxStage(
            sliced, start=0, end=2, first=False, last=False, n_ctx=128, n_seq_max=1, exact=True
        ) as part,
    ):
        a = whole.forward([StageInput(seq=0, pos=0, hidden=rows)])[0]
        b = part.forward([StageInput(seq=0, pos=0, hidden=rows)])[0]
    assert float(np.abs(a - b).max()) < SAME


def test_other_architectures_are_refused_by_name(tmp_path: Path) -> None:
    import mlx.core as mx

    def tiny(name: str, config: dict[str, Any]) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**_COMMON, "vocab_size": 16, **config}))
        mx.save_safetensors(
            str(path / "model.safetensors"), {"model.embed_tokens.weight": mx.zeros((16, HIDDEN))}
        )
        return path

    with pytest.raises(UnsupportedModelError, match=r"olmo2.*supported: .*gemma3_text.*qwen3"):
        check_folder_for_mlx(tiny("olmo", {"model_type": "olmo2"}))
    # Qwen's mlx-lm model has no sliding layers: it would compute something else.
    swa = {
        "model_type": "qwen3",
        "layer_types": ["sliding_attention"] * N_LAYERS,
        "sliding_window": 4,
    }
    with pytest.raises(UnsupportedModelError, match="sliding"):
        check_folder_for_mlx(tiny("qwen_swa", swa))

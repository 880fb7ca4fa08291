"""Write a llama GGUF out as an mlx-lm model folder (for tests and benchmarks).

meshd never downloads a model, so the MLX folders its tests and benchmarks run are made
here from a GGUF already on disk: MLX's own quantized layout, Q/K rows in Hugging Face's
rope order, and a ``tokenizer.json`` built from the GGUF vocabulary so ids agree with
llama.cpp's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import numpy as np

from .errors import ModelFormatError, UnsupportedModelError
from .mlx_layout import inspect_gguf, mlx_name

__all__ = ["gguf_to_mlx_folder"]

#: What ``mx.load(path, return_metadata=True)`` returns (its stub types every form of
#: its result as one union): the tensors by name, and the file's metadata.
_TensorsAndMetadata = tuple[dict[str, Any], dict[str, Any]]


def _unpermute(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's converter permutation of Q/K rows (interleaved rope pairs ->
    Hugging Face's half-split order). Works on any array whose rows are the output
    features: packed quantized weights, their scales and biases, and biases."""
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    # The converter did reshape(n_head, 2, half, ...).swapaxes(1, 2): GGUF rows are
    # (head, half, 2); swap back to (head, 2, half).
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _f32_repr(x: float) -> float:
    """The shortest decimal that is the same float32 (1e-05, not 9.99999974738e-06)."""
    return float(str(np.float32(x)))


#: GGUF pre-tokenizer names (``tokenizer.ggml.pre``) -> how llama.cpp splits text.
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2", "phi-2", "olmo", "jais", "trillion"})
#: Digits one by one (``\p{N}``), then GPT-2's split (llama.cpp's STARCODER group).
_DIGIT_PRE = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "pixtral"})
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen", "megrez"})
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4


def _meta(md: dict[str, Any], key: str, default: Any = None) -> Any:
    v = md.get(key, default)
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return v.item()
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


def _gguf_tokenizer(md: dict[str, Any], path: Path) -> tuple[Any, dict[str, Any]]:
    """A ``tokenizers`` Tokenizer equal to llama.cpp's for a byte-level BPE GGUF
    (``tokenizer.ggml.model == "gpt2"``), and the tokenizer_config.json entries."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = _meta(md, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{path}: tokenizer model {kind!r}: only byte-level BPE (gpt2) vocabularies "
            "are converted to a folder"
        )
    pre = _meta(md, "tokenizer.ggml.pre", "default")
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    types: list[int] = _meta(md, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelFormatError(f"{path}: the vocabulary repeats tokens")

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ignore_merges = False
    if pre in _GPT2_PRE:
        pre_tok: Any = byte_level
    elif pre in _DIGIT_PRE:
        pre_tok = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
        )
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        ignore_merges = pre in _LLAMA3_PRE
    else:
        raise UnsupportedModelError(f"{path}: GGUF pre-tokenizer {pre!r} is not converted")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        tid = _meta(md, f"tokenizer.ggml.{key}_token_id")
        return tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else None

    add_bos = bool(_meta(md, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_meta(md, "tokenizer.ggml.add_eos_token", False))
    bos, eos = token("bos"), token("eos")
    single = [
        *([f"{bos}:0"] if add_bos and bos else []),
        "$A:0",
        *([f"{eos}:0"] if add_eos and eos else []),
    ]
    specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
    if len(specials) == 2 and specials[0] == specials[1]:
        specials.pop()
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single),
        pair=" ".join([*single, *[s.replace("$A", "$B").replace(":0", ":1") for s in single]]),
        special_tokens=specials,
    )
    cfg: dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = md.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        cfg["chat_template"] = template
    return tok, {k: v for k, v in cfg.items() if v is not None}


def gguf_to_mlx_folder(gguf_path: Path | str, out_dir: Path | str) -> Path:
    """Write a llama GGUF out as an mlx-lm model folder; returns ``out_dir``.

    The folder is what ``mlx_lm.convert`` would make of the same weights:
    ``config.json`` (llama; ``"quantization": {"group_size": 32, "bits": 4}`` for
    Q4_0/Q4_1, with per-module entries for modules of other widths (Q8_0 -> 8 bits),
    Q6_K arrives dequantized as f16), ``model.safetensors`` with Hugging Face names
    and Q/K rows back in Hugging Face's rope order (``rope_traditional`` false), and
    ``tokenizer.json`` + ``tokenizer_config.json`` (chat template, bos/eos) built
    from the GGUF vocabulary so that ids agree with llama.cpp's. It loads with plain
    ``mlx_lm.load(out_dir)``. For tests and benchmarks: only llama GGUFs with a
    byte-level BPE vocabulary and no rope frequency factors are converted.
    """
    import mlx.core as mx

    gguf_path, out = Path(gguf_path), Path(out_dir)
    spec = inspect_gguf(gguf_path)
    if spec.has_rope_freqs:
        raise UnsupportedModelError(f"{gguf_path}: rope frequency factors are not converted")
    if not spec.mx_loadable:
        # mx.load reads this file whole below: it would get Q4_K wrong and fail on the
        # other types only the MLX stage's gguf_dequant path reads.
        raise UnsupportedModelError(
            f"{gguf_path}: only GGUFs mx.load reads whole (F32/F16/BF16, Q4_0, Q4_1, "
            "Q8_0, Q6_K) are converted"
        )
    weights, md = cast(_TensorsAndMetadata, mx.load(str(gguf_path), return_metadata=True))
    tok, tok_cfg = _gguf_tokenizer(md, gguf_path)

    tensors: dict[str, Any] = {}
    bits_of: dict[str, int] = {}
    for gname in list(weights):
        arr = weights.pop(gname)
        target = mlx_name(gname, 0, spec.n_layers)
        if target is None:
            continue
        mod, _, suffix = target.rpartition(".")
        if mod.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = spec.n_heads if mod.endswith("q_proj") else spec.n_kv_heads
            arr = _unpermute(arr, heads)
        tensors[target] = arr
        if suffix == "scales":
            bits_of[mod] = 0  # filled in below, once the packed weight is there
    for mod in bits_of:
        packed, scales = tensors[f"{mod}.weight"], tensors[f"{mod}.scales"]
        bits_of[mod] = packed.shape[-1] * 32 // (scales.shape[-1] * 32)

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32_repr(spec.rms_norm_eps),
        "rope_theta": _f32_repr(spec.rope_theta),
        "rope_scaling": (
            None
            if spec.rope_scale == 1.0
            else {"type": "linear", "rope_type": "linear", "factor": spec.rope_scale}
        ),
        "max_position_embeddings": spec.context_length or 2048,
        "vocab_size": spec.vocab_rows,
        "tie_word_embeddings": spec.tied,
        "attention_bias": spec.attention_bias,
        "mlp_bias": spec.mlp_bias,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos"):
        tid = _meta(md, f"tokenizer.ggml.{key}_token_id")
        if isinstance(tid, int):
            config[f"{key}_token_id"] = tid
    if bits_of:
        counts: dict[int, int] = {}
        for b in bits_of.values():
            counts[b] = counts.get(b, 0) + 1
        default = max(counts, key=lambda b: (counts[b], b))
        quant: dict[str, Any] = {"group_size": 32, "bits": default, "mode": "affine"}
        for mod, b in sorted(bits_of.items()):
            if b != default:
                quant[mod] = {"group_size": 32, "bits": b, "mode": "affine"}
        config["quantization"] = quant
        config["quantization_config"] = dict(quant)
    if not math.isfinite(config["rope_theta"]):
        raise ModelFormatError(f"{gguf_path}: bad rope_theta")

    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_cfg["model_max_length"] = config["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out

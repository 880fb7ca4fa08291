"""MLX / Hugging Face model folders (``config.json`` + ``*.safetensors``) for the MLX engine.

- :func:`is_mlx_folder`, :func:`inspect_folder` / :func:`check_folder_for_mlx`: what a
  folder holds and whether :class:`~meshd.engines.mlx_stage.MlxStage` can run it,
  from ``config.json`` and the safetensors JSON headers only (no tensor is read).
- :func:`read_folder_facts`: the placement facts (:class:`ModelFacts`, ``format="mlx"``).
- :func:`gguf_to_mlx_folder`: write a llama GGUF out as an mlx-lm folder (MLX's own
  quantized layout, Q/K rows in Hugging Face's rope order, a ``tokenizer.json`` built
  from the GGUF vocabulary): for tests and benchmarks, since meshd never downloads.

Supported architectures: llama-like configs (``model_type`` ``llama`` or ``mistral``:
mlx-lm builds both with its llama model). Weights may be unquantized (f32/f16/bf16) or
MLX-quantized (``"quantization"`` in config.json: affine at any bits/group size, with
per-module overrides, or the mxfp4/mxfp8/nvfp4 modes); other quantization schemes
(``quantization_config`` of AWQ, GPTQ, bitsandbytes...) are refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshd.crdt.views import ModelFacts

from .gguf_facts import ModelFormatError, file_sha256
from .mlx_stage import UnsupportedModelError

__all__ = [
    "FOLDER_ARCHITECTURES",
    "FolderModel",
    "check_folder_for_mlx",
    "gguf_to_mlx_folder",
    "inspect_folder",
    "is_mlx_folder",
    "read_folder_facts",
    "read_safetensors_header",
    "weight_files",
]

#: ``model_type`` values of config.json that the MLX stage builds (mlx-lm's llama model).
FOLDER_ARCHITECTURES = frozenset({"llama", "mistral"})

#: Rope scaling types mlx-lm's ``initialize_rope`` builds for a llama model.
_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3", "yarn", "longrope"})

#: K and V cache entries in the MLX stage: float32 (its residual stream is float32).
_MLX_KV_ELEMENT_BYTES = 4

#: Parameter names inside ``model.layers.N.`` that a llama layer has.
_LAYER_MODULES = frozenset(
    {
        "input_layernorm",
        "post_attention_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    }
)
_PARAM_SUFFIXES = ("weight", "bias", "scales", "biases")
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(\w+)$")
#: Tensors a checkpoint may carry that a model never loads.
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")
_ANY_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

#: Largest safetensors JSON header read (the format's own limit is 100 MB).
_MAX_HEADER = 100 << 20


# -- reading a folder ----------------------------------------------------------------


def is_mlx_folder(path: Path | str) -> bool:
    """Whether ``path`` is a model folder: a directory with ``config.json`` and at
    least one ``*.safetensors`` file."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def weight_files(path: Path | str) -> list[Path]:
    """The folder's weight files, as mlx-lm picks them: ``model*.safetensors``, else
    every ``*.safetensors`` (some repos also hold a ``consolidated.safetensors``)."""
    p = Path(path)
    files = sorted(p.glob("model*.safetensors")) or sorted(p.glob("*.safetensors"))
    return files


def read_safetensors_header(file: Path | str) -> dict[str, dict[str, Any]]:
    """Tensor name -> ``{"dtype", "shape", "data_offsets"}`` from a safetensors file's
    JSON header (8-byte little-endian length, then JSON); no tensor data is read."""
    file = Path(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelFormatError(f"{file}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ModelFormatError(f"{file}: not a safetensors file (header of {n} bytes)")
        text = f.read(n)
    try:
        header = json.loads(text)
    except ValueError as e:
        raise ModelFormatError(f"{file}: not a safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise ModelFormatError(f"{file}: not a safetensors file")
    header.pop("__metadata__", None)
    return header


def _load_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFormatError(f"{file}: not a JSON object")
    return data


@dataclass(frozen=True)
class FolderModel:
    """What the MLX stage needs to know about a folder before loading its tensors."""

    path: Path
    #: config.json, rope keys normalized (``rope_theta``/``rope_scaling``).
    config: dict[str, Any]
    model_type: str
    n_layers: int
    hidden_size: int
    n_ctx_train: int
    n_kv_heads: int
    head_dim: int
    embed_rows: int  # rows of embed_tokens (token ids it can embed)
    vocab_rows: int  # rows of the output head (logits per row)
    tied: bool  # the head is the embedding
    rope_traditional: bool
    #: config.json's ``quantization`` (None when the weights are not MLX-quantized).
    quantization: dict[str, Any] | None
    #: Weight files, and each tensor's file, dtype and shape (from the headers).
    files: tuple[Path, ...]
    tensors: dict[str, tuple[Path, str, tuple[int, ...], int]] = field(repr=False)


def _normalized_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with transformers 5's ``rope_parameters`` read back into the
    ``rope_theta``/``rope_scaling`` keys mlx-lm's llama model takes."""
    cfg = dict(config)
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and ("rope_type" in rp or "rope_theta" in rp):
        cfg.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
        if rp.get("rope_type", "default") != "default" and cfg.get("rope_scaling") is None:
            cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return cfg


def inspect_folder(path: Path | str) -> FolderModel:
    """Read and check a model folder's config and safetensors headers.

    Raises :class:`UnsupportedModelError` (naming the architecture, rope or
    quantization the MLX engine does not build), ModelFormatError for a folder that
    is not a usable model and FileNotFoundError for a missing one.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no model folder at {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelFormatError(f"{path}: no config.json (not a model folder)")
    config = _normalized_config(_load_json(cfg_file))
    files = weight_files(path)
    if not files:
        raise ModelFormatError(f"{path}: no *.safetensors weight files")

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelFormatError(f"{cfg_file}: no model_type")
    if model_type not in FOLDER_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {model_type!r} is not supported by the MLX engine "
            f"(supported: {', '.join(sorted(FOLDER_ARCHITECTURES))})"
        )
    quantization = config.get("quantization")
    if quantization is None and config.get("quantization_config"):
        qc = config["quantization_config"]
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise UnsupportedModelError(
            f"{path}: quantization {method!r} is not supported by the MLX engine "
            "(MLX-quantized or unquantized folders only)"
        )
    if quantization is not None and not isinstance(quantization, dict):
        raise ModelFormatError(f"{cfg_file}: quantization is not an object")
    scaling = config.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("type") or scaling.get("rope_type", "default")
        if kind not in _ROPE_TYPES:
            raise UnsupportedModelError(f"{path}: rope scaling {kind!r} is not supported")
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(
            f"{path}: layer types {sorted(set(layer_types))} (sliding-window layers) "
            "are not supported by the MLX engine"
        )

    def need_int(key: str) -> int:
        v = config.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ModelFormatError(f"{cfg_file}: {key} is missing or not a positive integer")
        return v

    n_layers = need_int("num_hidden_layers")
    hidden = need_int("hidden_size")
    n_heads = need_int("num_attention_heads")
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    head_dim = int(config.get("head_dim") or hidden // n_heads)

    tensors: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}
    for file in files:
        for name, info in read_safetensors_header(file).items():
            try:
                a, b = info["data_offsets"]
                entry = (file, str(info["dtype"]), tuple(int(d) for d in info["shape"]), b - a)
            except (KeyError, TypeError, ValueError) as e:
                raise ModelFormatError(f"{file}: bad header entry for {name!r}") from e
            tensors[name] = entry
    for name in tensors:
        if _IGNORED.search(name):
            continue
        m = _LAYER_TENSOR.match(name)
        if m is not None:
            if m.group(2) not in _LAYER_MODULES or m.group(3) not in _PARAM_SUFFIXES:
                raise UnsupportedModelError(
                    f"{path}: layer tensor {name!r} has no place in a llama layer "
                    "(an architecture variant the MLX engine does not build)"
                )
            if int(m.group(1)) >= n_layers:
                raise ModelFormatError(f"{path}: {name} is past the {n_layers} layers")

    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelFormatError(f"{path}: no model.embed_tokens.weight")
    tie = config.get("tie_word_embeddings")
    tied = bool(tie) if isinstance(tie, bool) else "lm_head.weight" not in tensors
    head = embed if tied else tensors.get("lm_head.weight")
    if head is None:
        raise ModelFormatError(f"{path}: tie_word_embeddings is false but no lm_head.weight")
    return FolderModel(
        path=path,
        config=config,
        model_type=model_type,
        n_layers=n_layers,
        hidden_size=hidden,
        n_ctx_train=int(config.get("max_position_embeddings") or 0),
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        embed_rows=embed[2][0],
        vocab_rows=head[2][0],
        tied=tied,
        rope_traditional=bool(config.get("rope_traditional", False)),
        quantization=quantization,
        files=tuple(files),
        tensors=tensors,
    )


def check_folder_for_mlx(path: Path | str) -> None:
    """Raise if the MLX engine cannot run this folder; return None if it can (see
    :func:`inspect_folder`). Reads config.json and the safetensors headers only."""
    inspect_folder(path)


def _quant_label(
    module: str, spec: FolderModel, tensors: dict[str, tuple[Path, str, tuple[int, ...], int]]
) -> str:
    """``mlx-q4``, ``mlx-q8``, ``mlx-mxfp4``...: how one quantized module is packed."""
    q = spec.quantization or {}
    over = q.get(module)
    params = over if isinstance(over, dict) else q
    mode = str(params.get("mode", "affine"))
    if mode != "affine":
        return f"mlx-{mode}"
    group = int(params.get("group_size", 64))
    packed = tensors[f"{module}.weight"][2]
    scales = tensors[f"{module}.scales"][2]
    bits = params.get("bits", 4)
    if packed and scales and scales[-1] and group:
        bits = packed[-1] * 32 // (scales[-1] * group)
    return f"mlx-q{bits}"


def read_folder_facts(path: Path | str, name: str, cache_dir: Path | None = None) -> ModelFacts:
    """Placement facts of a model folder, from config.json and safetensors headers.

    ``format="mlx"``; ``engines`` is ``["mlx"]``, or ``[]`` for an architecture the
    MLX engine does not build (:func:`check_folder_for_mlx` says why). ``sha256`` is a
    stable content id of the folder (see :func:`folder_sha256`).
    ``kv_bytes_per_token_layer`` counts float32 K and V entries, which is what the
    MLX stage keeps (its residual stream is float32), so it is twice a llama.cpp
    GGUF's f16 figure for the same model. Raises ModelFormatError for a folder that is
    not a model, FileNotFoundError for a missing one.
    """
    path = Path(path)
    try:
        spec = inspect_folder(path)
        engines = ["mlx"]
    except UnsupportedModelError:
        spec = _inspect_loosely(path)
        engines = []

    layer_bytes = [0] * spec.n_layers
    embed_bytes = head_bytes = 0
    types: set[str] = set()
    tensors = spec.tensors
    for tname, (_, dtype, _, nbytes) in tensors.items():
        if _IGNORED.search(tname):
            continue
        if spec.tied and tname.startswith("lm_head."):
            continue  # never loaded: the head is the embedding
        base, _, suffix = tname.rpartition(".")
        if suffix in ("scales", "biases") and f"{base}.weight" in tensors:
            pass
        elif suffix == "weight" and f"{base}.scales" in tensors:
            types.add(_quant_label(base, spec, tensors))
        else:
            types.add(dtype)
        m = _ANY_LAYER.search(tname)
        if m is not None:
            i = int(m.group(1))
            if i < spec.n_layers:
                layer_bytes[i] += nbytes
        elif tname.startswith(("lm_head.", "model.norm.")):
            head_bytes += nbytes
        else:
            embed_bytes += nbytes

    return ModelFacts(
        name=name,
        sha256=folder_sha256(path, cache_dir),
        format="mlx",
        architecture=spec.model_type,
        n_layers=spec.n_layers,
        hidden_size=spec.hidden_size,
        n_ctx_train=spec.n_ctx_train,
        layer_bytes=layer_bytes,
        embed_bytes=embed_bytes,
        head_bytes=head_bytes,
        kv_bytes_per_token_layer=2 * spec.n_kv_heads * spec.head_dim * _MLX_KV_ELEMENT_BYTES,
        quant_types=sorted(types),
        engines=engines,
    )


def _inspect_loosely(path: Path) -> FolderModel:
    """The facts-relevant part of :func:`inspect_folder` for a folder the engine
    refuses (another architecture): sizes are still worth reporting."""
    config = _normalized_config(_load_json(path / "config.json"))
    files = weight_files(path)
    tensors: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}
    for file in files:
        for tname, info in read_safetensors_header(file).items():
            a, b = info.get("data_offsets", (0, 0))
            tensors[tname] = (file, str(info.get("dtype")), tuple(info.get("shape", ())), b - a)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    get = lambda k: config.get(k) or text.get(k)  # noqa: E731
    n_layers = int(get("num_hidden_layers") or 0)
    hidden = int(get("hidden_size") or 0)
    n_heads = int(get("num_attention_heads") or 1)
    tie = get("tie_word_embeddings")
    return FolderModel(
        path=path,
        config=config,
        model_type=str(config.get("model_type") or "unknown"),
        n_layers=n_layers,
        hidden_size=hidden,
        n_ctx_train=int(get("max_position_embeddings") or 0),
        n_kv_heads=int(get("num_key_value_heads") or n_heads),
        head_dim=int(get("head_dim") or (hidden // n_heads if n_heads else 0)),
        embed_rows=0,
        vocab_rows=0,
        tied=bool(tie) if isinstance(tie, bool) else "lm_head.weight" not in tensors,
        rope_traditional=False,
        quantization=config.get("quantization"),
        files=tuple(files),
        tensors=tensors,
    )


#: Small files that decide what a folder computes besides its weights.
_ID_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def folder_sha256(path: Path | str, cache_dir: Path | None = None) -> str:
    """A stable content id (hex sha256) of a model folder.

    sha256 over a manifest of ``name sha256`` lines: config.json, tokenizer.json and
    tokenizer_config.json (those present), then every weight file, by name. Each
    file's own hash goes through :func:`~meshd.engines.gguf_facts.file_sha256`, so
    with ``cache_dir`` a folder is hashed once until a file changes.
    """
    path = Path(path)
    lines = ["meshd-mlx-folder-v1"]
    for fname in _ID_FILES:
        if (path / fname).is_file():
            lines.append(f"{fname} {file_sha256(path / fname, cache_dir)}")
    for file in weight_files(path):
        lines.append(f"{file.name} {file_sha256(file, cache_dir)}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# -- GGUF -> folder --------------------------------------------------------------------


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

    from .mlx_stage import _inspect_gguf, _mlx_name

    gguf_path, out = Path(gguf_path), Path(out_dir)
    spec = _inspect_gguf(gguf_path)
    if spec.has_rope_freqs:
        raise UnsupportedModelError(f"{gguf_path}: rope frequency factors are not converted")
    weights, md = mx.load(str(gguf_path), return_metadata=True)
    tok, tok_cfg = _gguf_tokenizer(md, gguf_path)

    tensors: dict[str, Any] = {}
    bits_of: dict[str, int] = {}
    for gname in list(weights):
        arr = weights.pop(gname)
        target = _mlx_name(gname, 0, spec.n_layers)
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

"""MLX / Hugging Face model folders (``config.json`` + ``*.safetensors``) for the MLX engine.

- :func:`is_mlx_folder`, :func:`inspect_folder` / :func:`check_folder_for_mlx`: what a
  folder holds and whether :class:`~meshd.engines.mlx_stage.MlxStage` can run it,
  from ``config.json`` and the safetensors JSON headers only (no tensor is read).
- :func:`read_folder_facts`: the placement facts (:class:`ModelFacts`, ``format="mlx"``).
- :func:`folder_sha256`: a stable content id of the folder.

(:func:`meshd.models.convert.gguf_to_mlx_folder` writes such a folder from a GGUF.)

Supported architectures (:data:`FOLDER_ARCHITECTURES`): ``model_type`` llama, mistral,
qwen2, qwen3, gemma3_text and phi3, each built with mlx-lm's own model of that type
(``mistral`` with its llama model, as mlx-lm does), and gemma3 (image-text Gemma 3:
its gemma3_text model only, see :func:`text_model`). Weights may be unquantized (f32/f16/bf16) or
MLX-quantized (``"quantization"`` in config.json: affine at any bits/group size, with
per-module overrides, or the mxfp4/mxfp8/nvfp4 modes); other quantization schemes
(``quantization_config`` of AWQ, GPTQ, bitsandbytes...) are refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.domain.facts import ModelFacts

from .errors import ModelFormatError, UnsupportedModelError
from .generation import folder_sampling
from .hashing import file_sha256
from .safetensors import read_safetensors_header

__all__ = [
    "FOLDER_ARCHITECTURES",
    "LAYER_OFFSET_KEY",
    "FolderModel",
    "check_folder_for_mlx",
    "folder_sha256",
    "inspect_folder",
    "is_mlx_folder",
    "read_folder_facts",
    "read_safetensors_header",
    "text_model",
    "weight_files",
]

#: Module names inside ``model.layers.N.`` that a llama layer has.
_LLAMA_LAYER = frozenset(
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
_QK_NORM = frozenset({"self_attn.q_norm", "self_attn.k_norm"})

#: Per ``model_type`` the MLX stage builds (with mlx-lm's model of that type), the
#: module names a layer of it has: a checkpoint with others is another variant.
_LAYER_MODULES: dict[str, frozenset[str]] = {
    "llama": _LLAMA_LAYER,
    "mistral": _LLAMA_LAYER,  # mlx-lm builds it with its llama model
    "qwen2": _LLAMA_LAYER,  # q/k/v biases are "bias" parameters of the same modules
    "qwen3": _LLAMA_LAYER | _QK_NORM,
    "gemma3_text": _LLAMA_LAYER
    | _QK_NORM
    | {"pre_feedforward_layernorm", "post_feedforward_layernorm"},
    "phi3": frozenset(
        {
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.qkv_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
        }
    ),
}

#: Gemma 3's image-text folders (``model_type`` gemma3): the text model is
#: ``text_config`` with its tensors under this prefix; the vision tower and projector
#: beside it are never loaded. (mlx-lm's gemma3 model wraps the gemma3_text one.)
_WRAPPED_TEXT = {"gemma3": ("gemma3_text", "language_model.")}

#: config.json ``model_type`` values the MLX stage builds (a copy: meshd.domain.builds).
FOLDER_ARCHITECTURES = frozenset(_LAYER_MODULES) | frozenset(_WRAPPED_TEXT)

#: Architectures whose mlx-lm model reads ``layer_types`` (sliding-window layers).
#: Gemma 3's model places its sliding layers by ``sliding_window_pattern`` itself; the
#: others would ignore sliding entries and compute something else than the checkpoint.
_LAYER_TYPES_READ = frozenset({"llama", "mistral"})
_SLIDING_OK = _LAYER_TYPES_READ | {"gemma3_text"}

#: Config key a folder slice (:mod:`meshd.models.folder_slicing`) writes: the whole
#: model's index of its first layer, for architectures whose layers depend on it.
LAYER_OFFSET_KEY = "meshd_layer_offset"

#: Rope scaling types mlx-lm builds (``initialize_rope``; phi3's ``su``).
_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "llama3", "yarn", "longrope", "su"})

#: K and V cache entries in the MLX stage: float32 (its residual stream is float32).
_MLX_KV_ELEMENT_BYTES = 4
_PARAM_SUFFIXES = ("weight", "bias", "scales", "biases")
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(\w+)$")
#: Tensors a checkpoint may carry that a model never loads.
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")
_ANY_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
    #: The whole model's index of layer 0 here (non-zero in a folder slice).
    layer_offset: int = 0
    #: What the files' tensor names have in front of the ``tensors`` keys (see
    #: :func:`text_model`).
    prefix: str = ""


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


def text_model(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The config of the text model a folder holds, and the prefix of its tensor names.

    A text model's config.json is its own (prefix ""). An image-text Gemma 3
    (``model_type`` gemma3) holds a gemma3_text model: its ``text_config`` with the
    top-level keys besides (quantization, ids), and the vocabulary size that mlx-lm's
    gemma3 model gives it (the top-level ``vocab_size``, 262208 by default); its
    tensors are named under ``language_model.``.
    """
    wrapped = _WRAPPED_TEXT.get(str(config.get("model_type")))
    text = config.get("text_config")
    if wrapped is None or not isinstance(text, dict):
        return config, ""
    model_type, prefix = wrapped
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    inner = {**outer, **text, "model_type": model_type}
    inner["vocab_size"] = config.get("vocab_size", 262208)
    return _normalized_config(inner), prefix


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
    config, prefix = text_model(config)
    model_type = str(config.get("model_type"))
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
    kinds = set(layer_types) - {"full_attention"}
    if kinds and (model_type not in _SLIDING_OK or kinds != {"sliding_attention"}):
        raise UnsupportedModelError(
            f"{path}: layer types {sorted(set(layer_types))} (sliding-window layers) "
            f"are not supported by the MLX engine for {model_type!r}"
        )
    if kinds and model_type in _LAYER_TYPES_READ:
        window = config.get("sliding_window")
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ModelFormatError(f"{cfg_file}: sliding layers but no sliding_window")
    offset = config.get(LAYER_OFFSET_KEY, 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ModelFormatError(f"{cfg_file}: {LAYER_OFFSET_KEY} is not a count of layers")

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
            if prefix:
                if not name.startswith(prefix):
                    continue  # another model's (a vision tower's): never loaded
                name = name[len(prefix) :]
            tensors[name] = entry
    for name in tensors:
        if _IGNORED.search(name):
            continue
        m = _LAYER_TENSOR.match(name)
        if m is not None:
            if m.group(2) not in _LAYER_MODULES[model_type] or m.group(3) not in _PARAM_SUFFIXES:
                raise UnsupportedModelError(
                    f"{path}: layer tensor {name!r} has no place in a {model_type} layer "
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
        layer_offset=offset,
        prefix=prefix,
    )


def check_folder_for_mlx(path: Path | str) -> None:
    """Raise if the MLX engine cannot run this folder; return None if it can (see
    :func:`inspect_folder`). Reads config.json and the safetensors headers only."""
    inspect_folder(path)


def _quant_label(
    module: str, spec: FolderModel, tensors: dict[str, tuple[Path, str, tuple[int, ...], int]]
) -> str:
    """``mlx-q4``, ``mlx-q8``, ``mlx-mxfp4``...: how one quantized module is packed."""
    params = _quant_params(module, spec)
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


def _quant_params(module: str, spec: FolderModel) -> dict[str, Any]:
    """How one module is quantized: its own entry of config.json's, else the whole's."""
    q = spec.quantization or {}
    over = q.get(module)
    return over if isinstance(over, dict) else q


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
    n_params = 0
    for tname, (_, dtype, shape, nbytes) in tensors.items():
        if _IGNORED.search(tname):
            continue
        if spec.tied and tname.startswith("lm_head."):
            continue  # never loaded: the head is the embedding
        base, _, suffix = tname.rpartition(".")
        if suffix in ("scales", "biases") and f"{base}.weight" in tensors:
            pass
        elif suffix == "weight" and f"{base}.scales" in tensors:
            types.add(_quant_label(base, spec, tensors))
            # Packed: a row holds as many values as its groups (one scale a group).
            groups = tensors[f"{base}.scales"][2][-1]
            group = int(_quant_params(base, spec).get("group_size", 64))
            n_params += math.prod(shape[:-1]) * groups * group
        else:
            types.add(dtype)
            n_params += math.prod(shape)
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
        n_vocab=spec.embed_rows,
        sampling=folder_sampling(path),
        n_params=n_params,
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
    text = tc if isinstance(tc := config.get("text_config"), dict) else {}
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
    file's own hash goes through :func:`~meshd.models.hashing.file_sha256`, so
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

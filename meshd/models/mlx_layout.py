"""How the MLX engine reads a model: which GGUF tensor types and architectures it can
load (``mx.load`` reads some types, :mod:`meshd.models.gguf_dequant` the others), and
under which mlx-lm module names each tensor of a GGUF or of a model folder goes in a
stage's model (layer ``start + i`` of the file is layer ``i`` of the stage).

Reads headers only (memory-mapped): nothing here loads a tensor or imports MLX.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from meshd.domain.builds import MLX_GGUF_ARCHITECTURES, build_refusal

from .errors import ModelFormatError, UnsupportedModelError
from .gguf import GgufHeader, read_header
from .quant_types import DEQUANT_TYPES

__all__ = [
    "GGUF_GROUP_SIZE",
    "MLX_ARCHITECTURES",
    "MLX_GGUF_TYPES",
    "MLX_TYPES",
    "GgufLayout",
    "UnsupportedQuantError",
    "check_gguf_for_mlx",
    "folder_name",
    "gguf_layout",
    "inspect_gguf",
    "layer_shift",
    "mlx_name",
]

#: GGUF tensor types that ``mx.load`` reads with correct values (ENGINE-NOTES): Q4_K
#: loads with wrong values and Q5_0/Q2_K/Q3_K/IQ4_NL do not load, so a file holding
#: any other type is read through gguf-py instead (:mod:`meshd.models.gguf_dequant`).
MLX_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q6_K"})

#: Every GGUF tensor type the MLX engine runs: those of ``MLX_TYPES`` plus those
#: gguf-py dequantizes (K-quants, Q5_0/Q5_1, IQ*); a model holding any other type
#: (F64, integer tensors, Q1_0...) is not offered to the MLX engine.
MLX_GGUF_TYPES = MLX_TYPES | DEQUANT_TYPES

#: GGUF architectures this stage builds (mlx-lm's llama model): the rule's own list
#: (:mod:`meshd.domain.builds`), which the model's facts and placement read too.
MLX_ARCHITECTURES = MLX_GGUF_ARCHITECTURES

#: Group size of every GGUF block quant that ``mx.load`` turns into affine weights,
#: and of every matrix :mod:`meshd.models.gguf_dequant` builds (its ``GROUP_SIZE``).
GGUF_GROUP_SIZE = 32

#: GGUF tensor name (inside ``blk.N.``) -> mlx-lm module path (inside ``model.layers.N.``).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR = re.compile(r"^blk\.\d+\.(\w+)\.(?:weight|bias)$")
#: Suffixes mx.load gives a GGUF tensor: the weight (packed uint32 when quantized),
#: its affine scales and biases, and a layer's own bias.
_SUFFIXES = ("weight", "scales", "biases", "bias")


class UnsupportedQuantError(UnsupportedModelError):
    """The GGUF holds tensor types the MLX engine cannot read (not in
    ``MLX_GGUF_TYPES``: neither ``mx.load`` nor gguf-py's dequantizer reads them).

    ``types`` lists the offending GGUF type names (``Q1_0``, ``F64``...), ``examples``
    one tensor of each.
    """

    def __init__(self, path: Path | str, examples: dict[str, str]) -> None:
        self.path = str(path)
        self.types = sorted(examples)
        self.examples = dict(examples)
        listed = ", ".join(f"{t} (e.g. {examples[t]})" for t in self.types)
        super().__init__(
            f"{path}: GGUF tensor type(s) {listed} cannot run on MLX "
            "(neither mx.load nor gguf-py's dequantizer reads them); "
            "use the llama_cpp engine or a Q4_K/Q4_0/Q8_0 file"
        )


@dataclass(frozen=True, slots=True)
class GgufLayout:
    """What the stage needs to know about a GGUF before loading its tensors."""

    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scale: float  # linear rope scaling factor (1.0 = none)
    context_length: int | None
    embed_rows: int  # rows of token_embd (token ids it can embed)
    vocab_rows: int  # rows of the output head (logits per row)
    tied: bool  # no output.weight: the head is token_embd
    has_rope_freqs: bool  # llama 3.1-style per-dimension rope factors
    attention_bias: bool
    mlp_bias: bool
    #: Every tensor type is one ``mx.load`` reads right (``MLX_TYPES``); if not, the
    #: stage reads its tensors through :func:`meshd.models.gguf_dequant.load_tensors`.
    mx_loadable: bool = True


def _meta_int(
    header: GgufHeader, key: str, path: Path, default: int | None = None, positive: bool = False
) -> int:
    v = header.kv.get(key)
    if v is None:
        if default is None:
            raise ModelFormatError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise UnsupportedModelError(f"{path}: per-layer {key} ({v}) is not supported")
        v = v[0]
    if int(v) <= 0 and positive:  # a divisor: 0 would divide by zero
        raise ModelFormatError(f"{path}: GGUF {key} is {v}")
    return int(v)


def inspect_gguf(path: Path) -> GgufLayout:
    """Read and check a GGUF's header (memory-mapped: no tensor data is read).

    Raises UnsupportedQuantError, UnsupportedModelError or ModelFormatError.
    """
    return gguf_layout(read_header(path), path)


def gguf_layout(header: GgufHeader, path: Path) -> GgufLayout:
    """Check a GGUF's header read already (``path``: the file, for the errors), as
    :func:`inspect_gguf`: the architecture first (:func:`build_refusal`), then its
    tensor types and layer tensors, then the shapes the stage builds."""
    arch = header.kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFormatError(f"{path}: GGUF metadata lacks general.architecture")
    why = build_refusal("mlx", "gguf", arch)
    if why is not None:
        raise UnsupportedModelError(f"{path}: {why}")
    bad: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    types: set[str] = set()
    for name, (type_name, shape) in header.tensors.items():
        if type_name not in MLX_GGUF_TYPES:
            bad.setdefault(type_name, name)
        types.add(type_name)
        shapes[name] = shape
    if bad:
        raise UnsupportedQuantError(path, bad)
    for name in header.tensors:
        if name.startswith("blk."):
            m = _LAYER_TENSOR.match(name)
            if m is None or m.group(1) not in _LAYER_NAMES:
                raise UnsupportedModelError(
                    f"{path}: layer tensor {name!r} has no place in a llama layer "
                    "(an architecture variant the MLX engine does not build)"
                )

    kv = header.kv
    n_layers = _meta_int(header, f"{arch}.block_count", path)
    hidden = _meta_int(header, f"{arch}.embedding_length", path)
    n_heads = _meta_int(header, f"{arch}.attention.head_count", path, positive=True)
    n_kv_heads = _meta_int(header, f"{arch}.attention.head_count_kv", path, n_heads)
    head_dim = _meta_int(header, f"{arch}.attention.key_length", path, hidden // n_heads)
    v_dim = _meta_int(header, f"{arch}.attention.value_length", path, head_dim)
    rope_dims = _meta_int(header, f"{arch}.rope.dimension_count", path, head_dim)
    if v_dim != head_dim or rope_dims != head_dim:
        raise UnsupportedModelError(
            f"{path}: key/value/rope dims {head_dim}/{v_dim}/{rope_dims} differ"
        )
    scaling = kv.get(f"{arch}.rope.scaling.type")
    factor = kv.get(f"{arch}.rope.scaling.factor")
    rope_scale = 1.0
    if scaling in (None, "none") or (scaling == "linear" and factor in (None, 1.0)):
        pass
    elif scaling == "linear" and factor is not None:  # (None took the branch above)
        rope_scale = float(factor)
    else:
        raise UnsupportedModelError(f"{path}: rope scaling {scaling!r} is not supported")

    embd = shapes.get("token_embd.weight")
    if embd is None:
        raise ModelFormatError(f"{path}: no token_embd.weight")
    head = shapes.get("output.weight", embd)
    if len(embd) != 2 or len(head) != 2:
        raise ModelFormatError(f"{path}: token_embd/output are not matrices")
    # GGUF shapes are (columns, rows): ne[0] is the hidden size.
    if embd[0] != hidden or head[0] != hidden:
        raise ModelFormatError(f"{path}: embedding width {embd[0]} is not {hidden}")
    ctx = kv.get(f"{arch}.context_length")
    return GgufLayout(
        n_layers=n_layers,
        hidden_size=hidden,
        intermediate_size=_meta_int(header, f"{arch}.feed_forward_length", path),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(kv.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
        rope_theta=float(kv.get(f"{arch}.rope.freq_base") or 10000.0),
        rope_scale=rope_scale,
        context_length=None if ctx is None else int(ctx),
        embed_rows=int(embd[1]),
        vocab_rows=int(head[1]),
        tied="output.weight" not in shapes,
        has_rope_freqs="rope_freqs.weight" in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        mlp_bias="blk.0.ffn_up.bias" in shapes,
        mx_loadable=types <= MLX_TYPES,
    )


def check_gguf_for_mlx(path: Path | str) -> None:
    """Raise if the MLX engine cannot run this GGUF; return None if it can.

    Reads only the header. Raises :class:`UnsupportedQuantError` naming the tensor
    types MLX cannot read (those outside ``MLX_GGUF_TYPES``: Q1_0, F64...),
    :class:`UnsupportedModelError` for an architecture or rope variant the engine
    does not build, ModelFormatError for a file that is not a usable GGUF model and
    FileNotFoundError for a missing one.
    """
    inspect_gguf(Path(path))


def mlx_name(gguf_name: str, start: int, end: int) -> str | None:
    """mlx-lm parameter path for a tensor from ``mx.load``; None if not this stage's.

    Layer ``start + i`` of the file is layer ``i`` of the stage's model.
    """
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        i = int(idx)
        if not start <= i < end:
            return None
        mapped = _LAYER_NAMES.get(part)
        if mapped is None:
            raise UnsupportedModelError(f"unknown layer tensor {gguf_name!r}")
        return f"model.layers.{i - start}.{mapped}.{suffix}"
    mapped = _GLOBAL_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{suffix}"


_FOLDER_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FOLDER_GLOBALS = ("model.embed_tokens.", "model.norm.", "lm_head.")


def folder_name(name: str, start: int, end: int) -> str | None:
    """The stage model's parameter path for a folder tensor; None if not this stage's.

    Layer ``start + i`` of the folder is layer ``i`` of the stage's model; rope
    frequency buffers some checkpoints carry are never loaded.
    """
    if name.endswith(".rotary_emb.inv_freq"):
        return None
    m = _FOLDER_LAYER.match(name)
    if m is not None:
        i = int(m.group(1))
        return f"model.layers.{i - start}.{m.group(2)}" if start <= i < end else None
    return name if name.startswith(_FOLDER_GLOBALS) else None


def layer_shift(path: str, start: int) -> str:
    """A stage model's module path with the folder's own layer number."""
    m = _FOLDER_LAYER.match(path)
    return path if m is None else f"model.layers.{int(m.group(1)) + start}.{m.group(2)}"

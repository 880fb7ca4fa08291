"""Small synthetic GGUF models for tests: real files llama.cpp loads, random weights."""

from __future__ import annotations

import functools
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from meshd.models.gguf import encode_kv, read_header, read_kv_records

#: Layers of every synthetic model.
N_LAYERS = 4


#: numpy dtypes of the GGUF numeric value types (gguf.GGUFValueType).
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip


def _array_value(order: str, raw: bytes) -> list[Any]:
    """The items of an array record as stored (``KvRecord.raw``: key, type, array)."""
    pos = 8 + struct.unpack_from(order + "Q", raw)[0] + 4  # past the key and its type
    item, n = struct.unpack_from(order + "IQ", raw, pos)
    pos += 12
    if item != gguf.GGUFValueType.STRING:
        dtype = np.dtype(_NUMPY[item]).newbyteorder(order)
        return np.frombuffer(raw, dtype, n, pos).tolist()
    out = []
    for _ in range(n):
        size = struct.unpack_from(order + "Q", raw, pos)[0]
        out.append(raw[pos + 8 : pos + 8 + size].decode())
        pos += 8 + size
    return out


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(path: str) -> tuple[tuple[str, Any, Any, Any], ...]:
    """Every ``tokenizer.*`` key of the GGUF at ``path``: (name, value, type, item type).
    Read from the raw header records, once a process (gguf-py's reader took 5 s of CPU
    over the default model's 49k-token vocabulary; this takes a tenth of that)."""
    order, _, records = read_kv_records(Path(path))
    out = []
    for r in records:
        if r.key.startswith("tokenizer."):
            kind = gguf.GGUFValueType(r.kind)
            if kind == gguf.GGUFValueType.ARRAY:
                item = gguf.GGUFValueType(r.item)
                out.append((r.key, _array_value(order, r.raw), kind, item))
            else:
                out.append((r.key, r.value, kind, None))
    return tuple(out)


def _copy_tokenizer(w: gguf.GGUFWriter, src: Path) -> int:
    """Copy every ``tokenizer.*`` key of ``src`` into ``w``; the vocabulary's size."""
    n_vocab = 0
    for name, value, kind, sub in _tokenizer_fields(str(src)):
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
        w.add_key_value(name, value, kind, sub_type=sub)
    return n_vocab


#: Architectures whose layers carry per-head q/k norms, or norms after attention and FFN,
#: or a mixture of experts (4, 2 used), or gate and up rows fused in ffn_up.
_QK_NORM = frozenset({"gemma3", "qwen3", "qwen3moe"})
_SANDWICH_NORM = frozenset({"gemma2", "gemma3"})
_MOE = frozenset({"qwen3moe"})
_FUSED_GATE_UP = frozenset({"phi3"})


def write_model(
    path: Path,
    tokenizer_from: Path,
    arch: str,
    *,
    bias: bool = False,
    tied: bool = True,
    metadata: Mapping[str, float | int] | None = None,
    context: int = 512,
) -> Path:
    """A 4-layer, 64-wide GGUF of ``arch`` with seeded random F32 weights and the
    tokenizer of ``tokenizer_from``; ``metadata``: more keys (a float is written as
    float32, an int as int32); ``context``: the trained context it declares."""

    rng = np.random.default_rng(7)
    hidden, heads, kv, ffn = 64, 4, 2, 128
    hd = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch in _MOE:
        w.add_uint32(f"{arch}.expert_count", 4)
        w.add_uint32(f"{arch}.expert_used_count", 2)
        w.add_uint32(f"{arch}.expert_feed_forward_length", 32)
    for key, value in (metadata or {}).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, np.uint32):
            w.add_uint32(key, int(value))
        else:
            w.add_int32(key, value)
    n_vocab = _copy_tokenizer(w, tokenizer_from)

    def t(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + t(hidden)).astype(np.float32)

    w.add_tensor("token_embd.weight", t(n_vocab, hidden, scale=0.5))
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm())
        for name, rows in (("attn_q", heads * hd), ("attn_k", kv * hd), ("attn_v", kv * hd)):
            w.add_tensor(p + name + ".weight", t(rows, hidden))
            if bias:
                w.add_tensor(p + name + ".bias", t(rows))
        w.add_tensor(p + "attn_output.weight", t(hidden, heads * hd))
        if arch in _QK_NORM:
            w.add_tensor(p + "attn_q_norm.weight", (1 + t(hd)).astype(np.float32))
            w.add_tensor(p + "attn_k_norm.weight", (1 + t(hd)).astype(np.float32))
        if arch in _SANDWICH_NORM:  # norms after attention and after the FFN too
            w.add_tensor(p + "post_attention_norm.weight", norm())
            w.add_tensor(p + "post_ffw_norm.weight", norm())
        w.add_tensor(p + "ffn_norm.weight", norm())
        if arch in _MOE:  # 4 experts of width 32, 2 used a token, a router
            w.add_tensor(p + "ffn_gate_inp.weight", t(4, hidden, scale=0.5))
            w.add_tensor(p + "ffn_gate_exps.weight", t(4, 32, hidden))
            w.add_tensor(p + "ffn_up_exps.weight", t(4, 32, hidden))
            w.add_tensor(p + "ffn_down_exps.weight", t(4, hidden, 32))
        elif arch in _FUSED_GATE_UP:  # gate and up rows in one tensor
            w.add_tensor(p + "ffn_up.weight", t(2 * ffn, hidden))
            w.add_tensor(p + "ffn_down.weight", t(hidden, ffn))
        else:
            w.add_tensor(p + "ffn_gate.weight", t(ffn, hidden))
            w.add_tensor(p + "ffn_up.weight", t(ffn, hidden))
            w.add_tensor(p + "ffn_down.weight", t(hidden, ffn))
    w.add_tensor("output_norm.weight", norm())
    if not tied:
        w.add_tensor("output.weight", t(n_vocab, hidden, scale=0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gpt2(path: Path, tokenizer_from: Path, *, context: int = 512) -> Path:
    """A 4-layer, 64-wide GPT-2 GGUF with seeded random F32 weights and the tokenizer
    of ``tokenizer_from``: learned position embeddings (``position_embd``, added to the
    token rows at the graph's input), layer norms with biases, fused QKV, a GELU FFN."""

    rng = np.random.default_rng(13)
    hidden, heads, ffn = 64, 4, 256
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_layer_norm_eps(1e-5)
    n_vocab = _copy_tokenizer(w, tokenizer_from)

    def t(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(prefix: str) -> None:
        w.add_tensor(prefix + ".weight", (1 + t(hidden)).astype(np.float32))
        w.add_tensor(prefix + ".bias", t(hidden))

    w.add_tensor("token_embd.weight", t(n_vocab, hidden, scale=0.5))
    w.add_tensor("position_embd.weight", t(context, hidden, scale=1.0))
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        norm(p + "attn_norm")
        for name, rows, cols in (
            ("attn_qkv", 3 * hidden, hidden), ("attn_output", hidden, hidden),
            ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn),
        ):  # fmt: skip
            w.add_tensor(p + name + ".weight", t(rows, cols, scale=0.5))
            w.add_tensor(p + name + ".bias", t(rows))
        norm(p + "ffn_norm")
    norm("output_norm")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_bert(path: Path, tokenizer_from: Path, *, pooling: int = 1) -> Path:
    """A 4-layer, 64-wide BERT (encoder-only, non-causal) GGUF with seeded random F32
    weights, the tokenizer of ``tokenizer_from`` and llama.cpp pooling type ``pooling``
    (1 mean, 2 CLS, 3 last): an embedding-only model as llama.cpp runs them."""

    rng = np.random.default_rng(11)
    hidden, heads, ffn, n_ctx = 64, 4, 128, 512
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_context_length(n_ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(pooling))
    w.add_token_type_count(2)
    n_vocab = _copy_tokenizer(w, tokenizer_from)

    def t(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(prefix: str) -> None:
        w.add_tensor(prefix + ".weight", (1 + t(hidden)).astype(np.float32))
        w.add_tensor(prefix + ".bias", t(hidden))

    w.add_tensor("token_embd.weight", t(n_vocab, hidden, scale=0.5))
    w.add_tensor("token_types.weight", t(2, hidden))
    w.add_tensor("position_embd.weight", t(n_ctx, hidden))
    norm("token_embd_norm")
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        for name, rows, cols in (
            ("attn_q", hidden, hidden), ("attn_k", hidden, hidden), ("attn_v", hidden, hidden),
            ("attn_output", hidden, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn),
        ):  # fmt: skip
            w.add_tensor(p + name + ".weight", t(rows, cols))
            w.add_tensor(p + name + ".bias", t(rows))
        norm(p + "attn_output_norm")
        norm(p + "layer_output_norm")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_f32_model(src: Path, dest: Path, n_layers: int, rope_factors: Any = None) -> None:
    """The first ``n_layers`` of ``src`` with every tensor dequantized to F32.

    On F32 weights llama.cpp's exact mode multiplies f32 by f32, so it is a true f32
    reference for an MLX stage. ``rope_factors`` adds a ``rope_freqs.weight`` tensor
    (Llama 3.1-style per-dimension rope frequency factors). The header is read from its
    raw records (gguf-py's reader took 5 s of CPU over the 49k-token vocabulary).
    """
    order, _, records = read_kv_records(Path(src))
    header = read_header(Path(src))
    arch = "llama"
    w = gguf.GGUFWriter(dest, arch)
    for r in records:
        if r.key.startswith("GGUF.") or r.key == gguf.Keys.General.ARCHITECTURE:
            continue
        kind = gguf.GGUFValueType(r.kind)
        sub = None
        if kind == gguf.GGUFValueType.ARRAY:
            value: Any = _array_value(order, r.raw)
            sub = gguf.GGUFValueType(r.item)
        else:
            value = r.value
        if r.key == f"{arch}.block_count":
            value = n_layers
        elif r.key == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        w.add_key_value(r.key, value, kind, sub_type=sub)
    buf = Path(src).read_bytes()
    for name, (qname, dims) in header.tensors.items():
        if name.startswith("blk.") and int(name.split(".")[1]) >= n_layers:
            continue
        qtype = gguf.GGMLQuantizationType[qname]
        raw = np.frombuffer(buf, np.uint8, header.nbytes[name], header.offsets[name])
        shape = tuple(reversed(dims))  # numpy's order: ne[0] last
        rows = raw.reshape(*shape[:-1], -1)
        w.add_tensor(name, gguf.quants.dequantize(rows, qtype).astype(np.float32))
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_factors, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def with_chat_template(src: Path, dest: Path, template: str) -> Path:
    """A copy of the GGUF ``src`` at ``dest`` whose ``tokenizer.chat_template`` is
    ``template``: the same weights and vocabulary under another template. The header's
    records are copied but that one, the tensor descriptors as they are, and the data
    from a start aligned again (its tensors' offsets are relative to it)."""
    order, _, records = read_kv_records(src)
    key = "tokenizer.chat_template"
    kv = [r.raw for r in records if r.key != key]
    kv.append(encode_kv(order, key, int(gguf.GGUFValueType.STRING), template))
    header = read_header(src)
    align = int(header.kv.get("general.alignment") or 32)
    with open(src, "rb") as f:
        head = f.read(24)  # magic, version, tensor count, record count
        n_tensors = struct.unpack_from(order + "Q", head, 8)[0]
        f.seek(24 + sum(len(r.raw) for r in records))
        infos = b""
        for _ in range(n_tensors):  # name, dims, each dim, type, offset
            name_len = struct.unpack(order + "Q", f.read(8))[0]
            part = struct.pack(order + "Q", name_len) + f.read(name_len)
            n_dims = struct.unpack(order + "I", f.read(4))[0]
            part += struct.pack(order + "I", n_dims) + f.read(8 * n_dims + 4 + 8)
            infos += part
        data_start = -(-f.tell() // align) * align
        prefix = head[:16] + struct.pack(order + "Q", len(kv)) + b"".join(kv) + infos
        with open(dest, "wb") as out:
            out.write(prefix + b"\0" * (-len(prefix) % align))
            f.seek(data_start)
            shutil.copyfileobj(f, out, 1 << 22)
    return dest

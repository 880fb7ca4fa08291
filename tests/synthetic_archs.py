"""Small synthetic GGUFs of the architectures households run (issue #32): each tensor
named and shaped as llama.cpp's loader wants it for that architecture, random F32
weights, the tokenizer of another GGUF. Tiny (64 wide, 4 or 6 layers) so the
architecture matrix (tests/engines/test_architectures.py) stays fast."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.synthetic import _copy_tokenizer

H, NH, KV, HD, FF = 64, 4, 2, 16, 128  # width, heads, KV heads, head width, FFN width
E, EU, EF = 4, 2, 32  # experts, of them used a token, expert FFN width
Tensors = list[tuple[str, tuple[int, ...]]]


def _base(n_layers: int) -> dict[str, Any]:
    return {"{a}.context_length": 512, "{a}.embedding_length": H, "{a}.block_count": n_layers,
            "{a}.feed_forward_length": FF, "{a}.attention.head_count": NH,
            "{a}.attention.head_count_kv": KV, "{a}.rope.freq_base": 10000.0,
            "{a}.attention.layer_norm_rms_epsilon": 1e-6}  # fmt: skip


_MOE = {"{a}.expert_count": E, "{a}.expert_used_count": EU, "{a}.expert_feed_forward_length": EF}
#: DeepSeek's routing (sigmoid, normalized) with one shared expert and a dense first layer.
_DEEPSEEK_MOE = {**_MOE, "{a}.expert_shared_count": 1, "{a}.leading_dense_block_count": 1,
                 "{a}.expert_weights_norm": True, "{a}.expert_weights_scale": 1.0,
                 "{a}.expert_gating_func": 2}  # fmt: skip


def _head(n_vocab: int, tied: bool = False) -> Tensors:
    out: Tensors = [("token_embd.weight", (n_vocab, H)), ("output_norm.weight", (H,))]
    return out if tied else [*out, ("output.weight", (n_vocab, H))]


def _attn(p: str, qk_norm: bool = False, bias: str = "") -> Tensors:
    """Q, K, V and output projections (numpy shapes: ggml's reversed); ``bias``: "qkv"
    or "qkvo", the projections with a bias."""
    rows = {"q": NH * HD, "k": KV * HD, "v": KV * HD, "o": H}
    names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}
    out: Tensors = [(p + names[x] + ".weight", (rows[x], NH * HD if x == "o" else H))
                    for x in "qkvo"]  # fmt: skip
    out += [(p + names[x] + ".bias", (rows[x],)) for x in bias]
    if qk_norm:
        out += [(p + "attn_q_norm.weight", (HD,)), (p + "attn_k_norm.weight", (HD,))]
    return out


def _dense(p: str) -> Tensors:
    return [(p + "ffn_gate.weight", (FF, H)), (p + "ffn_up.weight", (FF, H)),
            (p + "ffn_down.weight", (H, FF))]  # fmt: skip


def _moe(p: str, bias: bool = False, shared: bool = False) -> Tensors:
    out: Tensors = [(p + "ffn_gate_inp.weight", (E, H)), (p + "ffn_gate_exps.weight", (E, EF, H)),
                    (p + "ffn_up_exps.weight", (E, EF, H)),
                    (p + "ffn_down_exps.weight", (E, H, EF))]  # fmt: skip
    if bias:
        out += [(p + "ffn_gate_inp.bias", (E,)), (p + "ffn_gate_exps.bias", (E, EF)),
                (p + "ffn_up_exps.bias", (E, EF)), (p + "ffn_down_exps.bias", (E, H))]  # fmt: skip
    if shared:
        out += [(p + "ffn_gate_shexp.weight", (EF, H)), (p + "ffn_up_shexp.weight", (EF, H)),
                (p + "ffn_down_shexp.weight", (H, EF))]  # fmt: skip
    return out


def _norms(p: str, *names: str) -> Tensors:
    return [(p + n + ".weight", (H,)) for n in names]


DI, DS, NG, DC = 128, 16, 1, 4  # Mamba-2: inner width, state size, groups, conv kernel
NSH = DI // 16  # its heads
_SSM = {"{a}.ssm.conv_kernel": DC, "{a}.ssm.inner_size": DI, "{a}.ssm.state_size": DS,
        "{a}.ssm.time_step_rank": NSH, "{a}.ssm.group_count": NG}  # fmt: skip


def _mamba2(p: str) -> Tensors:
    conv = DI + 2 * NG * DS
    return [(p + "ssm_in.weight", (2 * DI + 2 * NG * DS + NSH, H)),
            (p + "ssm_conv1d.weight", (conv, DC)), (p + "ssm_conv1d.bias", (conv,)),
            (p + "ssm_dt.bias", (NSH,)), (p + "ssm_a", (NSH, 1)), (p + "ssm_d", (NSH, 1)),
            (p + "ssm_norm.weight", (NG, DI // NG)), (p + "ssm_out.weight", (H, DI))]  # fmt: skip


def _lfm2_mixer(p: str, i: int) -> Tensors:
    """LFM2's even layers mix by a short convolution (recurrent state), odd ones attend."""
    if i % 2:
        return _attn(p, qk_norm=True)
    return [(p + "shortconv.conv.weight", (H, 3)), (p + "shortconv.in_proj.weight", (3 * H, H)),
            (p + "shortconv.out_proj.weight", (H, H))]  # fmt: skip


def _layers(n: int, layer: Callable[[str, int], Tensors]) -> Tensors:
    return [t for i in range(n) for t in layer(f"blk.{i}.", i)]


#: The GGUF architectures households run, each: (architecture, layers, its keys, its
#: tensors for a vocabulary of n). Hybrids alternate recurrent and attention layers
#: over 6, so that a cut at 2 and at 2 and 4 leaves each stage both kinds.
ARCHS: dict[str, tuple[str, int, dict[str, Any], Callable[[int], Tensors]]] = {
    "gpt-oss": ("gpt-oss", 4, {**_base(4), **_MOE, "{a}.attention.sliding_window": 4},
                lambda nv: _head(nv) + _layers(4, lambda p, i: [
                    *_norms(p, "attn_norm", "post_attention_norm"), *_attn(p, bias="qkvo"),
                    (p + "attn_sinks.weight", (NH,)), *_moe(p, bias=True)])),
    "olmo2": ("olmo2", 4, _base(4), lambda nv: _head(nv) + _layers(4, lambda p, i: [
        *_attn(p), (p + "attn_q_norm.weight", (NH * HD,)), (p + "attn_k_norm.weight", (KV * HD,)),
        *_norms(p, "post_attention_norm", "post_ffw_norm"), *_dense(p)])),
    "mistral3": ("mistral3", 4, _base(4), lambda nv: _head(nv) + _layers(4, lambda p, i: [
        *_norms(p, "attn_norm", "ffn_norm"), *_attn(p), *_dense(p)])),
    "deepseek2": ("deepseek2", 4, {
        **_base(4), **_DEEPSEEK_MOE, "{a}.attention.head_count_kv": NH,
        "{a}.attention.q_lora_rank": 48, "{a}.attention.kv_lora_rank": 32,
        "{a}.attention.key_length": 24, "{a}.attention.value_length": 16,
        "{a}.rope.dimension_count": 8,
    }, lambda nv: _head(nv) + _layers(4, lambda p, i: [  # multi-head latent attention
        *_norms(p, "attn_norm", "ffn_norm"), (p + "attn_q_a.weight", (48, H)),
        (p + "attn_q_a_norm.weight", (48,)), (p + "attn_q_b.weight", (NH * 24, 48)),
        (p + "attn_kv_a_mqa.weight", (32 + 8, H)), (p + "attn_kv_a_norm.weight", (32,)),
        (p + "attn_kv_b.weight", (NH * (16 + 16), 32)), (p + "attn_output.weight", (H, NH * 16)),
        *(_dense(p) if i < 1 else [*_moe(p, shared=True), (p + "exp_probs_b.bias", (E,))])])),
    "lfm2": ("lfm2", 6, {**_base(6), "{a}.attention.head_count_kv": [0, KV] * 3,
                         "{a}.shortconv.l_cache": 3},
             lambda nv: [("token_embd.weight", (nv, H)), ("token_embd_norm.weight", (H,)),
                         *_layers(6, lambda p, i: [*_norms(p, "attn_norm", "ffn_norm"),
                                                   *_dense(p), *_lfm2_mixer(p, i)])]),
    "granitehybrid": ("granitehybrid", 6, {
        **_base(6), **_SSM, "{a}.attention.head_count_kv": [0, KV] * 3,
        "{a}.embedding_scale": 12.0, "{a}.residual_scale": 0.22, "{a}.logit_scale": 8.0,
        "{a}.attention.scale": 0.25,
    }, lambda nv: _head(nv) + _layers(6, lambda p, i: [
        *_norms(p, "attn_norm", "ffn_norm"), *_dense(p),
        *(_mamba2(p) if i % 2 == 0 else _attn(p))])),
    # Rope skipped on every 4th layer (llama.cpp sets it in code, from the layer index):
    # 12 layers, so that cuts at multiples of 4 make 2 and 3 stages.
    "smollm3": ("smollm3", 12, _base(12), lambda nv: _head(nv) + _layers(12, lambda p, i: [
        *_norms(p, "attn_norm", "ffn_norm"), *_attn(p), *_dense(p)])),
    # The same rope pattern, 3 of every 4 layers chunked, experts (one used, a shared one)
    # on every 2nd layer.
    "llama4": ("llama4", 12, {**_base(12), **_MOE, "{a}.expert_used_count": 1,
                              "{a}.interleave_moe_layer_step": 2},
               lambda nv: _head(nv) + _layers(12, lambda p, i: [
                   *_norms(p, "attn_norm", "ffn_norm"), *_attn(p),
                   *(_dense(p) if i % 2 == 0 else _moe(p, shared=True))])),
    # GLM-4.5: attention biases, a dense first layer, then sigmoid-routed experts with a
    # shared one.
    "glm4moe": ("glm4moe", 4, {**_base(4), **_DEEPSEEK_MOE}, lambda nv: _head(nv) + _layers(
        4, lambda p, i: [*_norms(p, "attn_norm", "post_attention_norm"), *_attn(p, bias="qkv"),
                         *(_dense(p) if i < 1 else [*_moe(p, shared=True),
                                                    (p + "exp_probs_b.bias", (E,))])])),
}  # fmt: skip


def _key_values(w: gguf.GGUFWriter, arch: str, keys: dict[str, Any]) -> None:
    for key, v in keys.items():
        key = key.replace("{a}", arch)
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, list):
            w.add_array(key, v)
        else:
            w.add_uint32(key, v)


def _weights(rng: np.random.Generator, tensors: Tensors) -> Iterator[tuple[str, np.ndarray]]:
    for name, shape in tensors:
        big = name in ("token_embd.weight", "output.weight") or "gate_inp" in name
        a = rng.standard_normal(shape) * (0.5 if big else 0.05)
        if name.endswith("norm.weight"):
            a += 1
        elif name.endswith("ssm_a"):  # A = -exp(A_log): negative, as converters store it
            a = -np.exp(rng.standard_normal(shape) * 0.5)
        yield name, a.astype(np.float32)


def write_arch(path: Path, tokenizer_from: Path, case: str) -> Path:
    """The GGUF of :data:`ARCHS` ``case`` at ``path`` (seeded random weights)."""
    arch, _, keys, tensors = ARCHS[case]
    w = gguf.GGUFWriter(str(path), arch)
    _key_values(w, arch, keys)
    n_vocab = _copy_tokenizer(w, tokenizer_from)
    for name, a in _weights(np.random.default_rng(7), tensors(n_vocab)):
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

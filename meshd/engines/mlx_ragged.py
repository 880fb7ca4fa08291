"""Several requests through one block of an mlx-lm model at once: the ragged batch.

An MLX stage's forward call concatenates the rows of every request it is given. The
token-wise work of a block (norms, projections, the MLP) runs once on all of them,
so on Metal each weight is read once for the batch; only attention (rope from the
request's offset, its own KV cache, the causal mask) runs request by request.

This re-implements the pre-norm block that mlx-lm's llama, qwen2, qwen3 and phi3
models share (mistral folders build the llama model): ``input_layernorm``, attention,
residual, ``post_attention_layernorm``, ``mlp``, residual. The attention differs only
in how it gets its queries, keys and values: biased projections (qwen2, carried by
the ``Linear``), per-head RMS norms before rope (qwen3's ``q_norm``/``k_norm``), or
one fused projection (phi3's ``qkv_proj``). Any other block (Gemma 3's, or one whose
layers attend through a window) runs through its own ``__call__``, one request at a
time (:func:`ragged_model`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ragged_block", "ragged_model"]


def ragged_model(model: Any, windows: list[int | None]) -> bool:
    """Whether the blocks of mlx-lm's ``model`` run ragged (:func:`ragged_block`):
    a model class whose block this module re-implements, no layer windowed."""
    from mlx_lm.models import llama, phi3, qwen2, qwen3

    return type(model) in (llama.Model, qwen2.Model, qwen3.Model, phi3.Model) and not any(windows)


def _qkv(attn: Any, x: Any) -> tuple[Any, Any, Any]:
    """Queries, keys and values of rows ``x`` (1, n, hidden), heads split out and their
    norms applied where the model has them: (1, n, heads, head width) each."""
    import mlx.core as mx

    n = x.shape[1]
    if hasattr(attn, "qkv_proj"):  # phi3: one projection, queries then keys then values
        q_end = attn.n_heads * attn.head_dim
        q, k, v = mx.split(attn.qkv_proj(x), [q_end, q_end + attn.n_kv_heads * attn.head_dim], -1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.reshape(1, n, attn.n_heads, -1)
    k = k.reshape(1, n, attn.n_kv_heads, -1)
    v = v.reshape(1, n, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3: RMS norm of each head, before rope
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def ragged_block(layer: Any, h: Any, spans: list[tuple[int, int, Any]]) -> Any:
    """Block ``layer`` on rows ``h`` (1, rows, hidden): each span ``(start, end, cache)``
    is one request's rows and that request's KV cache of this layer."""
    import mlx.core as mx

    attn = layer.self_attn
    q, k, v = _qkv(attn, layer.input_layernorm(h))
    outs = []
    for s, e, cache in spans:
        n = e - s
        qi = attn.rope(q[:, s:e].transpose(0, 2, 1, 3), offset=cache.offset)
        ki = attn.rope(k[:, s:e].transpose(0, 2, 1, 3), offset=cache.offset)
        ki, vi = cache.update_and_fetch(ki, v[:, s:e].transpose(0, 2, 1, 3))
        # "causal" aligns the rows to the end of the keys (offset = cached rows).
        o = mx.fast.scaled_dot_product_attention(
            qi, ki, vi, scale=attn.scale, mask="causal" if n > 1 else None
        )
        outs.append(o.transpose(0, 2, 1, 3).reshape(1, n, -1))
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    h = h + attn.o_proj(o)
    return h + layer.mlp(layer.post_attention_layernorm(h))

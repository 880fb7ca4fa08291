"""Several requests through one block of an mlx-lm model at once: the ragged batch.

An MLX stage's forward call concatenates the rows of every request it is given. The
token-wise work of a block (norms, projections, the MLP) runs once on all of them,
so on Metal each weight is read once for the batch; only attention (rope from the
request's offset, its own KV cache, its causal or window mask) runs request by
request.

This re-implements the blocks of mlx-lm's llama, qwen2, qwen3, phi3 and gemma3_text
models (mistral folders build the llama model; an image-text gemma3 runs its
gemma3_text model). Their attention differs only in how it gets its queries, keys and
values: biased projections (qwen2, carried by the ``Linear``), per-head RMS norms
before rope (qwen3's and Gemma 3's ``q_norm``/``k_norm``), or one fused projection
(phi3's ``qkv_proj``); the rope (Gemma 3's base per layer kind) and the query scale
(Gemma 3's ``query_pre_attn_scalar``) are the layer's own. The pre-norm block is
``input_layernorm``, attention, residual, ``post_attention_layernorm``, ``mlp``,
residual; Gemma 3's sandwich block norms the attention's output
(``post_attention_layernorm``) and the MLP's input and output
(``pre_feedforward_layernorm``, ``post_feedforward_layernorm``) and adds them through
its ``clip_residual``.

A layer with a window (Gemma 3's sliding layers, a llama's ``sliding_attention``)
keeps every position in its plain ``KVCache`` (the stage's rule: ``truncate`` and
``share`` need them) and attends only to the keys its window reaches, so its query
rows see what mlx-lm's ``RotatingKVCache`` would hold: each request's window from its
own offset.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ragged_block", "ragged_model"]


def ragged_model(model: Any) -> bool:
    """Whether the blocks of mlx-lm's ``model`` run ragged (:func:`ragged_block`): a
    model class whose block this module re-implements."""
    from mlx_lm.models import gemma3_text, llama, phi3, qwen2, qwen3

    return type(model) in (llama.Model, qwen2.Model, qwen3.Model, phi3.Model, gemma3_text.Model)


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
    if hasattr(attn, "q_norm"):  # qwen3, Gemma 3: RMS norm of each head, before rope
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def _window(keys: Any, values: Any, n: int, offset: int, window: int | None) -> tuple[Any, ...]:
    """The keys and values rows ``offset .. offset + n - 1`` attend to, and their mask:
    all cached rows, causal, without a window; else only the rows within ``window``
    positions of some query row, and a mask where a row reaches past its own window.
    The mask is None (one row) or "causal" (rows that all reach the first key) where
    that says the same."""
    import mlx.core as mx

    if window is None or offset + n <= window:
        return keys, values, "causal" if n > 1 else None
    lo = max(0, offset + 1 - window)  # the first key the first query row still sees
    keys, values = keys[..., lo:, :], values[..., lo:, :]
    if n == 1:
        return keys, values, None
    q_pos = mx.arange(offset, offset + n)[:, None]
    k_pos = mx.arange(lo, offset + n)[None]
    return keys, values, (k_pos <= q_pos) & (k_pos > q_pos - window)


def ragged_block(
    layer: Any, h: Any, spans: list[tuple[int, int, Any]], window: int | None = None
) -> Any:
    """Block ``layer`` on rows ``h`` (1, rows, hidden): each span ``(start, end, cache)``
    is one request's rows and that request's KV cache of this layer; ``window`` the
    layer's attention window (None: the whole context)."""
    import mlx.core as mx

    attn = layer.self_attn
    q, k, v = _qkv(attn, layer.input_layernorm(h))
    outs = []
    for s, e, cache in spans:
        n, offset = e - s, cache.offset
        qi = attn.rope(q[:, s:e].transpose(0, 2, 1, 3), offset=offset)
        ki = attn.rope(k[:, s:e].transpose(0, 2, 1, 3), offset=offset)
        ki, vi = cache.update_and_fetch(ki, v[:, s:e].transpose(0, 2, 1, 3))
        # "causal" aligns the rows to the end of the keys (offset = cached rows).
        ki, vi, mask = _window(ki, vi, n, offset, window)
        o = mx.fast.scaled_dot_product_attention(qi, ki, vi, scale=attn.scale, mask=mask)
        outs.append(o.transpose(0, 2, 1, 3).reshape(1, n, -1))
    o = attn.o_proj(outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1))
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3's sandwich norms
        from mlx_lm.models.gemma3_text import clip_residual

        h = clip_residual(h, layer.post_attention_layernorm(o))
        r = layer.mlp(layer.pre_feedforward_layernorm(h))
        return clip_residual(h, layer.post_feedforward_layernorm(r))
    h = h + o
    return h + layer.mlp(layer.post_attention_layernorm(h))

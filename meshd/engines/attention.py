"""Which attention kernels a llama.cpp stage runs, and what KV kept for no request (a
cached prefix) costs it: pure rules, shared by the stage that applies them and the
supervisor that gives every stage of a pipeline the same prefix budget.

Measured on the default model (2 threads, llama.cpp's CPU kernels):

- Flash attention reads a sequence's own cells ~3x slower than plain attention, so its
  decode slows with the context: one row at 16 / 250 / 1,000 / 2,000 positions took
  5.1 / 10.0 / 16.5 / 29.0 ms with it and 5.9 / 6.6 / 9.0 / 13.4 ms without; 8 rows of
  1,000 positions each 138 and 105 ms, of 100 positions 39 and 40 ms; a prefill 3.1
  and 3.4 ms a token. llama.cpp's ``auto`` picks flash attention on the CPU.
- All sequences share one KV buffer and every row reads up to its highest cell in use.
  Plain attention computes every cell in range: 3.9-4.5 us a cell a row (a decode row
  took 6.7 ms alone, 11.3 ms beside a kept 1,024-cell sequence). Flash attention skips
  other sequences' cells: 0.7-0.9 us (5.9 and 6.8 ms).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["flash_attn", "kept_rows", "pipeline_kept_rows"]


def flash_attn(
    kv_cache: str, n_gpu_layers: int, exact: bool = False, choice: bool | None = None
) -> bool | None:
    """Whether a llama.cpp stage runs flash attention (None: llama.cpp's own choice).

    ``exact`` is the F32 reference path (plain); a quantized V cache needs flash
    attention (llama.cpp refuses it without); ``choice`` decides for f16 K/V; else
    plain attention on the CPU (see the module notes) and llama.cpp's choice with GPU
    layers."""
    if exact:
        return False
    if kv_cache != "f16":
        return True
    if choice is not None:
        return choice
    return None if n_gpu_layers > 0 else False


def kept_rows(flash: bool | None) -> int:
    """Rows of other work after which a sequence kept for no request has cost a
    llama.cpp stage what computing it again would.

    Keeping n cells costs a*n a row computed, and a hit saves b*n (its prefill): past
    b/a rows keeping it has cost more, whatever n. On the default model b is 2.7-3.1
    ms a token, so b/a is 680-780 with plain attention and 2,900-4,900 with flash
    attention (a from the module notes). A larger model has a larger b/a (its prefill
    grows with its weights, its cells with its KV width only): there a prefix goes
    early, and a chat that comes back after it computes its history again."""
    return 768 if flash is False else 3072


def pipeline_kept_rows(stages: Iterable[tuple[str, str, int]]) -> int:
    """The prefix budget of a pipeline whose stages are ``(engine, kv_cache,
    n_gpu_layers)``: the least of its llama.cpp stages' (every stage drops a prefix
    at the same count, so none drops one that stage 0 still names); 0, never, when
    no stage pays for kept KV (MLX sequences have caches of their own)."""
    rows = [
        kept_rows(flash_attn(kv_cache, gpu)) for engine, kv_cache, gpu in stages if engine != "mlx"
    ]
    return min(rows, default=0)

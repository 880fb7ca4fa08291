"""The attention rules of llama.cpp stages and the prefix budget of a pipeline
(pure functions; the measured costs behind them are in meshd.engines.attention)."""

from __future__ import annotations

import pytest

from meshd.engines.attention import flash_attn, kept_rows, pipeline_kept_rows


@pytest.mark.parametrize(
    ("kv_cache", "gpu", "exact", "choice", "want"),
    [
        ("f16", 0, False, None, False),  # the CPU: plain attention
        ("f16", 12, False, None, None),  # GPU layers: llama.cpp's choice
        ("q8_0", 0, False, None, True),  # a quantized V cache needs flash attention
        ("q4_0", 0, False, False, True),
        ("f16", 0, True, True, False),  # the F32 reference path is plain
        ("f16", 0, False, True, True),  # a choice decides for f16 K/V
    ],
)
def test_which_attention_a_stage_runs(
    kv_cache: str, gpu: int, exact: bool, choice: bool | None, want: bool | None
) -> None:
    assert flash_attn(kv_cache, gpu, exact, choice) is want


def test_kept_kv_goes_sooner_where_plain_attention_pays_for_every_cell() -> None:
    assert kept_rows(False) < kept_rows(True) == kept_rows(None)


def test_every_stage_of_a_pipeline_gets_the_least_budget_of_its_stages() -> None:
    cpu = ("llama_cpp", "f16", 0)
    gpu = ("llama_cpp", "f16", 33)
    mlx = ("mlx", "f16", 0)
    assert pipeline_kept_rows([gpu, cpu]) == pipeline_kept_rows([cpu]) == kept_rows(False)
    assert pipeline_kept_rows([gpu, gpu]) == kept_rows(None)
    assert pipeline_kept_rows([("llama_cpp", "q8_0", 0)]) == kept_rows(True)
    assert pipeline_kept_rows([mlx, cpu]) == kept_rows(False)
    assert pipeline_kept_rows([mlx, mlx]) == 0  # MLX sequences have caches of their own

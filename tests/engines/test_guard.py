"""The activation guard (meshd.engines.guard): what a stage refuses to send on, and
the fault drill that makes a runner produce it."""

from __future__ import annotations

import numpy as np
import pytest

from meshd.engines.guard import OUTPUT_BOUND, fault_injection, hop_dtype, output_fault


def test_a_sound_output_passes_and_a_corrupt_one_says_what_is_wrong() -> None:
    rows = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
    rows[0, 5] = 2500.0  # a "massive activation", as real models have
    assert output_fault(rows) is None
    assert output_fault(np.zeros((0, 64), np.float32)) is None
    bad = rows.copy()
    bad[1, 2], bad[2, 3] = np.nan, np.inf
    assert output_fault(bad) == "1 NaN and 1 infinite values in its output of 192"
    bad = rows.copy()
    bad[2, 7] = -3 * OUTPUT_BOUND
    assert "-3e+06" not in (why := output_fault(bad) or "") and "3e+06" in why
    # An f16 hop holds at most 65504: such a step goes as float32, sound, not a fault.
    big = rows.copy()
    big[0, 0] = 70000.0
    assert output_fault(big) is None
    assert hop_dtype(big, "f16") == "f32" and hop_dtype(rows, "f16") == "f16"
    assert hop_dtype(big, "bf16") == "bf16" and hop_dtype(big, "f32") == "f32"


def test_the_fault_drill_corrupts_from_its_nth_output_on() -> None:
    assert fault_injection("") is None
    with pytest.raises(ValueError, match="nan@N or huge@N"):
        fault_injection("nan")
    out = np.ones((2, 8), np.float32)
    nan = fault_injection("nan@3")
    assert nan is not None
    assert nan(out) is out and nan(out) is out
    assert np.isnan(nan(out)).any() and np.isnan(nan(out)).any() and out.all()
    huge = fault_injection("huge@1")
    assert huge is not None and output_fault(huge(out)) is not None
    assert output_fault(out) is None  # the drill never touches what it was given

"""The activation guard: a stage checks what it computed before it sends it on.

A faulty stage (a bad GPU driver, memory that flips bits, a corrupt slice) makes NaN,
Inf or huge values. Passed on, they surface as the last stage's sampler refusing the
logits, a 400 that blames the client, or as garbage text nobody flags. So every stage
checks each output (hidden rows or logits): not finite, or a magnitude past
:data:`OUTPUT_BOUND` (or past what the wire type holds), is a *stage fault*. The
runner ends the request with the typed error ``stage_fault`` naming its stage, and
reports itself failed (:data:`~meshd.engines.protocol.STAGE_FAULT`): its node gives
the runner up, placement moves the stage away, and the request replays on the
repaired plan (``meshd.node.requests``).

A check is one pass over the output: ~0.1 ms for a row of 576 floats or the 49152
logits of the default model, well under a step.

``$MESHD_FAULT_INJECT`` is a fault drill, read by runners only (tests, and an operator
who wants to see a failover): ``nan@N`` or ``huge@N`` corrupt this runner's outputs
from its ``N``-th step on.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import numpy as np

__all__ = ["FAULT_ENV", "OUTPUT_BOUND", "fault_injection", "hop_dtype", "output_fault"]

#: Largest magnitude an output value may have. Real models' hidden rows hold a few
#: "massive activations" of up to ~1e4; logits stay within tens. A million is far
#: above both and far below what corrupt weights make.
OUTPUT_BOUND = 1e6

#: The fault drill's variable (see the module doc).
FAULT_ENV = "MESHD_FAULT_INJECT"

_WIRE_MAX = {"f16": float(np.finfo(np.float16).max)}


def output_fault(out: np.ndarray) -> str | None:
    """Why ``out`` (a stage's output) is corrupt, in words, or None when it is sound."""
    if out.size == 0:
        return None
    finite = np.isfinite(out)
    if not finite.all():
        nan = int(np.isnan(out).sum())
        inf = int(out.size - finite.sum()) - nan
        return f"{nan} NaN and {inf} infinite values in its output of {out.size}"
    peak = float(np.abs(out).max())
    if peak > OUTPUT_BOUND:
        return f"a value of {peak:.3g} in its output, past the bound {OUTPUT_BOUND:.3g}"
    return None


def hop_dtype(out: np.ndarray, wanted: str) -> str:
    """The wire type to send sound rows ``out`` as: ``wanted``, unless a value is past
    what it holds (f16 ends at 65504, and a real model's massive activations come
    within a factor of three of it): that step goes as float32, so a sound output
    is never turned into an infinity and blamed on the stage."""
    limit = _WIRE_MAX.get(wanted)
    if limit is not None and out.size and float(np.abs(out).max()) > limit:
        return "f32"
    return wanted


def fault_injection(spec: str | None = None) -> Callable[[np.ndarray], np.ndarray] | None:
    """The fault drill ``spec`` asks for (default: ``$MESHD_FAULT_INJECT``): a function
    that passes outputs through until its ``N``-th call, then corrupts them; None when
    none is asked. Raises ValueError for a spec it does not understand."""
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    if not spec:
        return None
    m = re.fullmatch(r"(nan|huge)@(\d+)", spec.strip())
    if m is None:
        raise ValueError(f"${FAULT_ENV} must be nan@N or huge@N, not {spec!r}")
    kind, start = m[1], int(m[2])
    calls = 0

    def inject(out: np.ndarray) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls < start:
            return out
        bad = np.array(out, dtype=np.float32, copy=True)
        if kind == "nan":
            bad.reshape(-1)[:: max(1, bad.size // 7)] = np.nan
        else:
            bad *= 1e9
        return bad

    return inject

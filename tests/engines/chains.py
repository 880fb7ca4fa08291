"""Greedy decoding through a chain of in-process stages: the reference the engine tests
compare splits, batches and architectures with."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshd.engines.stage import Stage, StageInput


def greedy(
    chain: Sequence[Stage], prompt: Sequence[int], n: int, seq: int = 0
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens (and the logits they came from) through a chain of stages."""
    out: list[int] = []
    logits: list[np.ndarray] = []
    pos = 0
    cur = np.asarray(prompt, np.int32)
    try:
        for _ in range(n):
            x = chain[0].forward([StageInput(seq=seq, pos=pos, tokens=cur)])[0]
            for stage in chain[1:]:
                x = stage.forward([StageInput(seq=seq, pos=pos, hidden=x)])[0]
            pos += len(cur)
            tok = int(np.argmax(x))
            out.append(tok)
            logits.append(x)
            cur = np.array([tok], np.int32)
    finally:
        # Stages shared by a module's tests: a failing run must not leave its sequence.
        for stage in chain:
            stage.free(seq)
    return out, logits

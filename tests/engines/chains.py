"""Greedy decoding through a chain of stages, token ids in and hidden rows handed
on, for the tests that hold a split to its whole model (or one engine to another)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshd.engines.stage import Stage, StageInput


def greedy(
    chain: Sequence[Stage], prompt: Sequence[int], n: int, seq: int = 0
) -> tuple[list[int], list[np.ndarray]]:
    """``n`` greedy tokens and the logits of each step through ``chain`` (sequence
    ``seq`` of every stage, freed after, also when a step fails: stages a module's
    tests share must not keep it)."""
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    pos = 0
    cur = np.asarray(prompt, np.int32)
    try:
        for _ in range(n):
            x = chain[0].forward([StageInput(seq=seq, pos=pos, tokens=cur)])[0]
            for stage in chain[1:]:
                x = stage.forward([StageInput(seq=seq, pos=pos, hidden=x)])[0]
            assert x.shape == (chain[-1].n_vocab,)
            pos += len(cur)
            tokens.append(int(np.argmax(x)))
            logits.append(x)
            cur = np.array([tokens[-1]], np.int32)
    finally:
        for stage in chain:
            stage.free(seq)
    return tokens, logits


def worst(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """The largest absolute difference between two runs' logits, step by step."""
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))

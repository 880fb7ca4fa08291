"""Chunked prefill: stage 0 cuts a prompt's tokens into chunks, each a step of its own.

Each chunk's rows go on to the next stage as soon as they are computed (one
``Activation`` per chunk, at its absolute position), so the next stage works on chunk
``k`` while this one computes chunk ``k + 1``: over ``S`` stages a prompt's first token
comes after about the slowest stage's share plus one chunk per other stage, not after
the sum of every stage's. A step takes one item per request (:func:`.step.take_batch`),
so other requests' decode steps run in the same engine call as each chunk: a stream
waits at most one chunk's compute for a long prompt, never its whole prefill.

How many rows a chunk holds (:func:`chunk_rows`):

* in the exact mode, the engine's own ``n_batch``: the engine runs a longer input as
  calls of ``n_batch`` rows counted from its first anyway, so each chunk is one of the
  calls an unchunked prompt makes, and every float sum is the one it made;
* otherwise rows for about :data:`CHUNK_TARGET_S` of compute at the measured pace of
  this stage's prompt steps (:class:`PrefillPace`), at least :data:`MIN_CHUNK_ROWS`
  and at most ``n_batch`` (before any step is measured, ``n_batch``). A chunk's
  transfer and its compute both grow with its rows, so the link does not change which
  of the two is longer; what it adds per chunk (its latency) overlaps the next chunk.

``$MESHD_PREFILL_CHUNK`` (read by runners, for benchmarks) fixes the rows of every
chunk, exact mode too; ``0`` runs a prompt in one step, as before chunks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .state import Request, Work

#: Fixes every chunk's rows (``0``: a prompt in one step); for benchmarks.
CHUNK_ENV = "MESHD_PREFILL_CHUNK"
#: Compute a chunk aims at: what a decode step beside a long prompt waits at most.
CHUNK_TARGET_S = 0.25
#: Fewest rows a chunk holds: below this an engine call's fixed cost and the
#: matrix kernels' poorer use of small batches start to show.
MIN_CHUNK_ROWS = 64


def fixed_rows(environ: Mapping[str, str] | None = None) -> int | None:
    """The rows ``$MESHD_PREFILL_CHUNK`` fixes (0: unchunked), or None when unset.
    ValueError for a value that is no count."""
    raw = (os.environ if environ is None else environ).get(CHUNK_ENV, "").strip()
    if not raw:
        return None
    n = int(raw)
    if n < 0:
        raise ValueError(f"${CHUNK_ENV} must be 0 or more, not {raw!r}")
    return n


class PrefillPace:
    """Seconds per row of this stage's prompt steps (an average that follows the
    machine's load)."""

    def __init__(self) -> None:
        self.s_per_row = 0.0

    def record(self, rows: int, seconds: float) -> None:
        """One engine call of ``rows`` rows took ``seconds``; only calls with enough
        rows to time a prefill are counted (a decode step's rows cost more each)."""
        if rows < MIN_CHUNK_ROWS // 2 or seconds <= 0:
            return
        pace = seconds / rows
        self.s_per_row = pace if self.s_per_row <= 0 else 0.7 * self.s_per_row + 0.3 * pace


def chunk_rows(n_batch: int, s_per_row: float, exact: bool, fixed: int | None = None) -> int:
    """Rows of each chunk of a prompt (0: the prompt in one step); see the module doc."""
    if fixed is not None:
        return fixed
    if exact or s_per_row <= 0:
        return n_batch
    return max(min(MIN_CHUNK_ROWS, n_batch), min(n_batch, int(CHUNK_TARGET_S / s_per_row)))


def split(w: Work, rows: int) -> list[Work]:
    """``w`` (a prompt's token step at stage 0) as steps of at most ``rows`` rows, in
    order; the first carries the request's ``start`` (the next stage seats it on it)."""
    if rows <= 0 or w.tokens is None or w.parts is not None or w.draft or len(w.tokens) <= rows:
        return [w]
    return [
        Work(w.req, w.pos + i, tokens=w.tokens[i : i + rows], start=w.start if i == 0 else None,
             epoch=w.epoch)
        for i in range(0, len(w.tokens), rows)
    ]  # fmt: skip


class Chunker:
    """Stage 0's chunking of prompts: rows by the engine's ``n_batch``, the measured
    pace and ``$MESHD_PREFILL_CHUNK``."""

    def __init__(self, n_batch: int) -> None:
        #: Rows of the engine's own calls (0: an engine that does not say; then
        #: prompts run whole).
        self.n_batch = n_batch
        self.pace = PrefillPace()
        self.fixed = fixed_rows()

    def cut(self, r: Request, work: list[Work]) -> list[Work]:
        """A newly admitted request's ``work`` with its prompt step cut into chunks;
        an embeddings request's stays whole (its last stage pools every row at once)."""
        if r.embed or not work:
            return work
        rows = chunk_rows(self.n_batch, self.pace.s_per_row, r.exact, self.fixed)
        return [*split(work[0], rows), *work[1:]]

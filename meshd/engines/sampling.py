"""Token sampling from a logits vector: pure numpy, deterministic under a seed.

The last rank of a plan samples, whatever engine computed the logits, so sampling lives
here and not in an engine: an MLX rank and a llama.cpp rank given the same logits and
the same seed pick the same token.

Order of the filters, as in Hugging Face ``generate``: temperature scaling, then top-k,
then top-p (nucleus) on the renormalised remainder, then one uniform draw inverted over
the kept tokens in token-id order. Ties are broken towards the lower token id everywhere
(greedy, the top-k boundary, the nucleus boundary), so the token depends only on the
logits, the parameters, the seed and the token's position.

The uniform draw of the token at position ``i`` is a pure function of ``(seed, i)``
(a counter-based generator: a keyed hash of the position), not the i-th output of a
stateful stream. A request replayed from position ``k`` (its first ``k`` tokens
re-prefilled on a repaired plan) therefore draws exactly what the uninterrupted run
would have drawn, without replaying ``k`` draws it cannot know the shape of.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import secrets
import struct

import msgspec
import numpy as np

__all__ = ["MAX_TEMPERATURE", "Sampler", "SamplingParams", "uniform"]

MAX_TEMPERATURE = 2.0
"""OpenAI's upper bound for ``temperature``."""

# The draw hashes the seed as an unsigned 64-bit word; folding a signed seed into this
# range keeps every int64 a client may send valid and distinct.
_SEED_MASK = (1 << 64) - 1

# 53 random bits make every double in [0, 1) on a 2**-53 grid reachable, as numpy's
# Generator.random() does.
_UNIT = 2.0**-53

# Buckets for top-k / top-p selection: enough that the bucket holding the boundary has
# a few dozen tokens on a 49k vocabulary, few enough that the bincount stays cheap.
_BINS = 2048

# Block size for drawing from a long distribution (see _invert_cdf).
_BLOCK = 512


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick the next token; defaults are OpenAI's (plain sampling at T=1).

    ``temperature`` 0 means greedy (argmax). ``top_k`` 0 disables top-k. ``seed`` None
    draws from fresh OS entropy; an int makes the sequence of draws reproducible.
    Invalid values raise ``ValueError`` at construction (and a ``msgspec.ValidationError``
    when decoded from the wire).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        # `not (a <= x <= b)` rather than `x < a or x > b` so that NaN is rejected too.
        if not _is_real(self.temperature) or not (0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), "
                f"got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (no randomness is consumed)."""
        return self.temperature == 0.0


def _is_real(value: object) -> bool:
    # bool is an int subclass; `temperature=True` is a client bug, not a number.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Sampler:
    """Picks token ids from logits under fixed :class:`SamplingParams`.

    One sampler per request. The token at position ``i`` (0 = the first generated
    token) uses the uniform draw :func:`uniform` ``(seed, i)``: the same seed and the
    same logits at a position give the same token whatever happened before, so a
    sampler created at ``position=k`` continues an interrupted stream exactly. Each
    call moves to the next position. Not thread-safe (it reuses work arrays).
    """

    def __init__(self, params: SamplingParams | None = None, position: int = 0) -> None:
        """``position``: index of the next token to sample (the tokens already sent)."""
        self.params = params if params is not None else SamplingParams()
        seed = self.params.seed
        # No seed: a fresh random one, so an unseeded request still draws independently
        # per position (and a replay of it continues with the same draws).
        self._seed = secrets.randbits(64) if seed is None else int(seed) & _SEED_MASK
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        #: Position of the next token :meth:`sample` picks.
        self.position = position
        self._work = _Work()

    def sample(self, logits: np.ndarray, position: int | None = None) -> int:
        """Return the token id at ``position`` (default :attr:`position`) for a 1-D
        logits vector (one entry per vocab id); the next call defaults to the next
        position.

        ``-inf`` entries are masked tokens and are never picked. Raises ``ValueError`` on
        an empty or non 1-D vector, on NaN or ``+inf``, or when every entry is ``-inf``.
        """
        pos = self.position if position is None else position
        x = np.asarray(logits)
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float64)
        top = float(x.max())  # NaN anywhere propagates into the max: one pass checks both
        if not math.isfinite(top):
            raise ValueError(f"logits must be finite or -inf, max is {top}")
        self.position = pos + 1

        p = self.params
        if p.temperature == 0.0:
            # np.argmax returns the first maximum: the lowest id, like llama.cpp greedy.
            return int(np.argmax(x))

        work = self._work
        work.reserve(x.size)
        ids: np.ndarray | None = None
        if 0 < p.top_k < x.size:
            ids = np.flatnonzero(_best_prefix(x, None, p.top_k, work))
            x = x[ids]
        n = x.size
        # exp in float32 is ~10x faster than in float64 (SIMD); sums and the draw are
        # float64 so the nucleus boundary does not drift over a 49k vocabulary.
        scaled = work.f32[:n]
        np.subtract(x, top, out=scaled, casting="same_kind")
        scaled *= 1.0 / p.temperature
        np.exp(scaled, out=scaled)
        probs = work.f64[:n]
        np.copyto(probs, scaled)

        if p.top_p < 1.0:
            # Zero the tokens outside the nucleus rather than compacting: the draw skips
            # zero weights, and compacting would allocate a vocab-sized array per call.
            probs *= _best_prefix(x, probs, p.top_p * probs.sum(), work)

        i = _invert_cdf(probs, uniform(self._seed, pos))
        return int(i if ids is None else ids[i])


def uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) of the token at ``position`` under ``seed``.

    A keyed hash of the position (BLAKE2b of both as 64-bit words, 53 bits kept): a
    counter-based generator, so any position's draw costs ~1 us and needs no state.
    Unlike a numpy stream it is fixed by this definition, not by a library version,
    so every node of a cluster draws the same number.
    """
    key = struct.pack("<QQ", seed & _SEED_MASK, position & _SEED_MASK)
    word = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return (word >> 11) * _UNIT


class _Work:
    """Work arrays reused across calls.

    Arrays of a 49k vocabulary are larger than glibc's mmap threshold, so each fresh one
    costs page faults; reusing them took a plain draw from ~0.4 ms to ~0.1 ms.
    """

    def __init__(self) -> None:
        self.f32 = np.empty(0, np.float32)
        self.f64 = np.empty(0, np.float64)
        self.key = np.empty(0, np.intp)

    def reserve(self, n: int) -> None:
        """Make every array hold at least ``n`` entries."""
        if self.f32.size < n:
            self.f32 = np.empty(n, np.float32)
            self.f64 = np.empty(n, np.float64)
            self.key = np.empty(n, np.intp)


def _best_prefix(
    values: np.ndarray, weights: np.ndarray | None, budget: float, work: _Work
) -> np.ndarray:
    """Mask of the shortest prefix, in canonical order, whose weight reaches ``budget``.

    Canonical order is larger value first, lower index first among equal values. With
    ``weights`` None every entry weighs 1, so this is top-k with ``budget`` = k; with
    probabilities it is the top-p nucleus (the entry that crosses ``budget`` is kept, as
    in llama.cpp and Hugging Face, so at least one entry survives).

    A full sort of 49k logits costs ~2 ms and argpartition ~0.4 ms; instead the values
    are bucketed into ``_BINS`` equal-width bins below the maximum, a bincount finds the
    bin where the running weight reaches the budget, and only that bin is sorted.
    """
    n = values.size
    top = float(values.max())
    low = float(values.min())
    if not math.isfinite(low):  # masked (-inf) tokens: bin over the finite range
        low = float(values[np.isfinite(values)].min())
    span = top - low
    # Capped so that a tiny span cannot overflow float32 and turn 0 * inf into NaN.
    scale = min((_BINS - 1) / span, 1e30) if span > 0.0 else 1.0
    dist = work.f32[:n]  # free here: the caller is done with its float32 scratch
    np.subtract(top, values, out=dist, casting="same_kind")
    dist *= scale
    # Clamp in float before the int cast: -inf logits give +inf here, which would wrap.
    np.minimum(dist, _BINS - 1, out=dist)
    key = work.key[:n]
    np.copyto(key, dist, casting="unsafe")

    running = np.cumsum(np.bincount(key, weights=weights, minlength=_BINS))
    b = min(int(np.searchsorted(running, budget, side="left")), _BINS - 1)
    before = running[b - 1] if b else 0.0
    edge = np.flatnonzero(key == b)
    # flatnonzero is ascending, so a stable sort on -value yields (value desc, index asc).
    edge = edge[np.argsort(-values[edge], kind="stable")]
    edge_weights = np.ones(edge.size) if weights is None else weights[edge]
    reached = np.cumsum(edge_weights) + before
    cut = int(np.searchsorted(reached, budget, side="left")) + 1

    keep = key < b
    keep[edge[:cut]] = True
    return keep


def _invert_cdf(weights: np.ndarray, u: float) -> int:
    """Index where the running sum of ``weights`` (id order) first exceeds ``u`` * total.

    A float64 cumsum over 49k entries costs ~0.17 ms; summing blocks first and then
    scanning one block gives the same answer (up to rounding) for a tenth of that.
    """
    if weights.size <= 8 * _BLOCK:
        return _search(weights, u * weights.sum())
    block_mass = np.add.reduceat(weights, np.arange(0, weights.size, _BLOCK))
    target = u * block_mass.sum()
    j = _search(block_mass, target)
    lo = j * _BLOCK
    target -= block_mass[:j].sum()
    return lo + _search(weights[lo : lo + _BLOCK], target)


def _search(weights: np.ndarray, target: float) -> int:
    """First index whose running sum exceeds ``target``; never a zero-weight entry."""
    cdf = np.cumsum(weights)
    # side="right" skips zero weights: their running sum equals the previous one.
    i = int(np.searchsorted(cdf, target, side="right"))
    if i >= cdf.size:  # target rounded up to the total: the last entry with weight
        i = int(np.flatnonzero(weights)[-1])
    return i

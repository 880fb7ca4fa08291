"""Token sampling from a logits vector: pure numpy, deterministic under a seed.

The last rank of a plan samples, whatever engine computed the logits, so sampling lives
here and not in an engine: an MLX rank and a llama.cpp rank given the same logits and
the same seed pick the same token.

Order of the steps:

1. ``logit_bias`` is added to the logits (OpenAI: -100 bans a token, +100 forces it).
2. Penalties over the tokens generated so far (the prompt is not counted): OpenAI's
   ``frequency_penalty`` (times the token's count) and ``presence_penalty`` (once, if it
   occurred) are subtracted; llama.cpp's ``repeat_penalty`` divides a positive logit and
   multiplies a negative one, for the tokens among the last ``repeat_last_n``.
3. Temperature scaling (0: greedy, the argmax of the adjusted logits).
4. top-k, then top-p (nucleus) on the renormalised remainder, then min-p (tokens less
   likely than ``min_p`` times the most likely one are dropped), as Hugging Face's
   warpers do after temperature.
5. One uniform draw inverted over the kept tokens in token-id order.

Ties are broken towards the lower token id everywhere (greedy, the top-k boundary, the
nucleus boundary), so the token depends only on the logits, the parameters, the tokens
generated before, the seed and the token's position.

The uniform draw of the token at position ``i`` is a pure function of ``(seed, i)``
(a counter-based generator: a keyed hash of the position), not the i-th output of a
stateful stream. A request replayed from position ``k`` (its first ``k`` tokens
re-prefilled on a repaired plan, and given to the sampler as its history) therefore
draws exactly what the uninterrupted run would have drawn, without replaying ``k``
draws it cannot know the shape of.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from collections import Counter, deque
from collections.abc import Iterable

import msgspec
import numpy as np

from meshd.domain.sampling import MAX_TOP_LOGPROBS, Sampling

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Draw",
    "Sampler",
    "log_probs",
    "uniform",
]

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


class Sampler:
    """Picks token ids from logits under a fixed :class:`~meshd.domain.sampling.Sampling`.

    One sampler per request. The token at position ``i`` (0 = the first generated
    token) uses the uniform draw :func:`uniform` ``(seed, i)``: the same seed and the
    same logits at a position give the same token whatever happened before, so a
    sampler created at ``position=k`` with the ``k`` tokens already generated as its
    ``history`` continues an interrupted stream exactly (penalties included). Each call
    moves to the next position and adds its token to the history. Not thread-safe (it
    reuses work arrays).
    """

    def __init__(
        self, params: Sampling | None = None, position: int = 0, history: Iterable[int] = ()
    ) -> None:
        """``position``: index of the next token to sample (the tokens already sent);
        ``history``: those tokens, in order (what the penalties count). A value of
        ``params`` that breaks its rule raises :class:`SamplingError` (a ValueError)."""
        self.params = params if params is not None else Sampling()
        self.params.check()
        seed = self.params.seed
        # No seed: a fresh random one, so an unseeded request still draws independently
        # per position (and a replay of it continues with the same draws).
        self._seed = secrets.randbits(64) if seed is None else int(seed) & _SEED_MASK
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        #: Position of the next token :meth:`sample` picks.
        self.position = position
        self._work = _Work()
        p = self.params
        self._counts: Counter[int] = Counter()
        window = None if p.repeat_last_n < 0 else p.repeat_last_n
        self._recent: deque[int] = deque(maxlen=window)
        self._bias_ids = np.fromiter(p.logit_bias, np.intp, len(p.logit_bias))
        self._bias = np.fromiter(p.logit_bias.values(), np.float64, len(p.logit_bias))
        for tok in history:
            self.accept(tok)

    def accept(self, token: int) -> None:
        """Count ``token`` as generated (:meth:`sample` does it for the tokens it picks)."""
        self._counts[token] += 1
        self._recent.append(token)

    def sample(self, logits: np.ndarray, position: int | None = None) -> int:
        """Return the token id at ``position`` (default :attr:`position`) for a 1-D
        logits vector (one entry per vocab id); the next call defaults to the next
        position, and the token joins the history the penalties count.

        ``-inf`` entries are masked tokens and are never picked. Raises ``ValueError`` on
        an empty or non 1-D vector, on NaN or ``+inf``, when every entry is ``-inf``, or
        when ``logit_bias`` names a token past the vocabulary.
        """
        return self.draw(logits, position).token

    def draw(
        self, logits: np.ndarray, position: int | None = None, logprobs: int | None = None
    ) -> Draw:
        """:meth:`sample`, with the token's log-probability and the ``logprobs`` most
        likely tokens' when ``logprobs`` is not None (see :func:`log_probs`)."""
        pos = self.position if position is None else position
        x = np.asarray(logits)
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float64)
        top = float(x.max())  # NaN anywhere propagates into the max: one pass checks both
        if not math.isfinite(top):
            raise ValueError(f"logits must be finite or -inf, max is {top}")
        if self._bias_ids.size or (self.params.penalised and self._counts):
            x = self._adjust(x)
            top = float(x.max())
            if not math.isfinite(top):
                raise ValueError("logit_bias and penalties left no token to sample")
        self.position = pos + 1
        tok = self._pick(x, top, pos)
        self.accept(tok)
        if logprobs is None:
            return Draw(tok)
        return log_probs(x, self.params.temperature, tok, logprobs)

    def _adjust(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with the bias and the penalties applied (float32: the
        engines' own precision; the copy keeps the caller's array untouched)."""
        x = np.array(logits, dtype=np.float32)
        p = self.params
        if self._bias_ids.size:
            if int(self._bias_ids.max()) >= x.size:
                raise ValueError(
                    f"logit_bias names token {int(self._bias_ids.max())}, past the "
                    f"vocabulary of {x.size} tokens"
                )
            x[self._bias_ids] += self._bias
        if not p.penalised or not self._counts:
            return x
        if p.presence_penalty or p.frequency_penalty:
            ids = np.fromiter(self._counts, np.intp, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float32, len(self._counts))
            ok = ids < x.size
            ids, counts = ids[ok], counts[ok]
            x[ids] -= counts * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
        if p.repeat_penalty != 1.0 and self._recent:
            ids = np.unique(np.fromiter(self._recent, np.intp, len(self._recent)))
            ids = ids[ids < x.size]
            v = x[ids]
            x[ids] = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        return x

    def _pick(self, x: np.ndarray, top: float, pos: int) -> int:
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
        if p.min_p > 0.0:
            # probs are relative to the most likely token (its weight is exp(0) = 1), so
            # the cut is min_p itself; the most likely token always survives it.
            probs[probs < p.min_p] = 0.0

        i = _invert_cdf(probs, uniform(self._seed, pos))
        return int(i if ids is None else ids[i])


class Draw(msgspec.Struct, frozen=True):
    """A sampled token; with its log-probability and the most likely tokens' when asked."""

    token: int
    logprob: float = 0.0
    #: (token, log-probability), most likely first (ties: lower id first).
    top: list[tuple[int, float]] = []


def log_probs(logits: np.ndarray, temperature: float, token: int, n_top: int) -> Draw:
    """``token``'s log-probability and the ``n_top`` most likely tokens' under the
    distribution it was sampled from: the logits as the sampler saw them (bias and
    penalties applied) at ``temperature`` (1 when greedy), before the top-k, top-p and
    min-p cuts (so a token they removed still has its probability, and a greedy
    request still reports the model's confidence).
    """
    z = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    m = float(z.max())
    lse = m + math.log(float(np.exp(z - m).sum()))
    n = min(n_top, z.size)
    top: list[tuple[int, float]] = []
    if n > 0:
        edge = float(z[np.argpartition(-z, n - 1)[n - 1]])  # the n-th largest value
        above = np.flatnonzero(z > edge)
        ties = np.flatnonzero(z == edge)[: n - above.size]
        # (value desc, id asc): the order every other cut in this module uses.
        order = sorted([*above.tolist(), *ties.tolist()], key=lambda i: (-z[i], i))
        # A token masked out (-inf, by a grammar) is no alternative.
        top = [(int(i), float(z[i] - lse)) for i in order if z[i] > -math.inf]
    return Draw(token, float(z[token] - lse), top)


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

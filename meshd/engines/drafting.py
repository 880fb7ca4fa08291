"""Draft tokens for speculative decoding, from the request's own tokens.

Prompt lookup: the last few tokens written are looked for earlier in the request (its
prompt and its answer so far); what followed them there is the draft. Code edits,
summaries and answers over a document repeat their input, and the lookup costs
microseconds, far less than the pass it saves (a proposer must be much cheaper than a
decode step over the pipeline to pay). The last stage verifies every drafted row in
one pass and keeps the longest agreeing run (see ``meshd.engines.runner``).

:class:`DraftBudget` adapts how many tokens to draft to how many were accepted, and
stops drafting for a request where it does not pay.

Over a split, a drafted step can be *chained*: its draft names one token more than
its rows, the first row of the next step, which stage 0 sends right away instead of
waiting for the step to come back. While the last stage verifies one step, the stages
before it compute the next, so a split's stages work at once on one stream where the
text repeats; :class:`InFlight` keeps stage 0's account of them.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["DraftBudget", "InFlight", "Step", "prompt_lookup"]

#: Longest and shortest n-gram looked for (longer first: a longer match predicts better).
MAX_NGRAM = 3
MIN_NGRAM = 2
#: Tokens looked back over (the search is O(window)).
WINDOW = 8192


def prompt_lookup(tokens: Sequence[int], k: int, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last
    n-gram of ``tokens`` (n from :data:`MAX_NGRAM` down to ``min_ngram``); none
    when nothing repeats. A match so recent that fewer than ``k`` tokens follow it
    goes on from the draft so far (text in a loop: its period, again)."""
    draft = _lookup(tokens, k, min_ngram)
    while draft and len(draft) < k:
        more = _lookup([*tokens[-WINDOW:], *draft], k - len(draft), min_ngram)
        if not more:
            break
        draft += more
    return draft


def _lookup(tokens: Sequence[int], k: int, min_ngram: int) -> list[int]:
    if k <= 0 or len(tokens) < min_ngram + 1:
        return []
    arr = np.asarray(tokens[-WINDOW:], np.int64)
    end = len(arr)
    for n in range(min(MAX_NGRAM, end - 1), min_ngram - 1, -1):
        # Starts j < end - n of earlier occurrences of the last n tokens, found in one
        # vectorized pass per token of the n-gram (no Python loop over the hits: a
        # common token occurs thousands of times in a long prompt).
        match = np.ones(end - n, bool)
        for i in range(n):
            match &= arr[i : end - n + i] == arr[end - n + i]
        hits = np.flatnonzero(match)
        if len(hits):
            j = int(hits[-1])  # the most recent
            return [int(t) for t in arr[j + n : j + n + k]]
    return []


#: Plain steps timed before a request drafts: the baseline a draft must beat.
WARMUP_STEPS = 3
#: Drafted steps between two decisions on whether drafting pays.
TRIAL_STEPS = 6
#: Plain steps after which a request that stopped drafting tries again (its text,
#: or the links, may have changed).
RETRY_STEPS = 64
#: Weight of the newest step in the running mean of a plain step.
EMA = 0.3


@dataclass
class DraftBudget:
    """How many tokens to draft for one request, from how its drafts fared.

    ``k`` grows by one after a draft accepted whole and falls to what was accepted
    plus one otherwise. Whether drafting pays is measured, not guessed: stage 0 times
    each step from feeding a token to getting the next (the trip around the ring and
    every stage's compute), plain steps and drafted ones alike. Every
    :data:`TRIAL_STEPS` drafted steps, a request whose seconds per token over its
    drafted steps so far are not below its plain steps' stops drafting (a model whose
    compute, not the trip, sets the pace, or text that does not repeat), as does one
    whose drafts are mostly wrong (under ``min_rate`` accepted). The totals, not a
    running mean, decide: one draft thrown away whole does not end a run of good ones.
    After :data:`RETRY_STEPS` plain steps it tries again from a clean slate.
    """

    k_max: int
    k: int = 0
    drafted: int = 0
    accepted: int = 0
    min_rate: float = 0.25
    #: Running mean of a plain step's seconds; totals of the drafted steps of this try.
    plain_s: float = 0.0
    spec_seconds: float = 0.0
    spec_tokens: int = 0
    n_plain: int = 0
    n_spec: int = 0
    off: bool = False
    #: Plain steps since drafting stopped.
    n_off: int = 0

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    @property
    def on(self) -> bool:
        """Whether to draft at the next step."""
        return self.k_max > 0 and not self.off and self.n_plain >= WARMUP_STEPS

    @property
    def spec_s(self) -> float:
        """Seconds per token of the drafted steps of this try (0: none timed)."""
        return self.spec_seconds / self.spec_tokens if self.spec_tokens else 0.0

    def plain(self, seconds: float) -> None:
        """A step without a draft took ``seconds``."""
        self.plain_s = _mean(self.plain_s, seconds, self.n_plain)
        self.n_plain += 1
        if self.off:
            self.n_off += 1
            if self.n_off >= RETRY_STEPS:
                self.off, self.n_off = False, 0
                self.spec_seconds, self.spec_tokens, self.n_spec = 0.0, 0, 0
                self.drafted = self.accepted = 0
                self.k = self.k_max

    def record(self, drafted: int, accepted: int, seconds: float = 0.0, bonus: bool = True) -> None:
        """A draft of ``drafted`` tokens had its first ``accepted`` taken, in a step
        of ``seconds`` (0: not timed). ``bonus``: the step also gave the token after
        them (a chained step held whole gives none: its last draft token is the next
        step's first)."""
        self.drafted += drafted
        self.accepted += accepted
        # (A chained step drafts one more than k: its next step's first token.)
        grown = self.k + 1 if accepted == drafted else max(1, accepted + 1)
        self.k = min(self.k_max, grown)
        if seconds > 0:
            self.spec_seconds += seconds
            self.spec_tokens += accepted + bonus
            self.n_spec += 1
        if (
            self.n_spec
            and self.n_spec % TRIAL_STEPS == 0
            and (self.spec_s >= self.plain_s or self.accepted < self.min_rate * self.drafted)
        ):
            self.off = True


def _mean(mean: float, x: float, n: int) -> float:
    return x if n == 0 else (1 - EMA) * mean + EMA * x


class Step(NamedTuple):
    """A step stage 0 sent for a request: fed at ``pos``, with ``k`` tokens drafted
    (or asked of a draft model that gave none in time). A ``chained`` step runs
    ``k`` rows, its last draft token being the next step's first, fed at ``pos + k``."""

    pos: int
    k: int = 0
    chained: bool = False


class InFlight:
    """Stage 0's steps of one request that have not come back, oldest first.

    The last stage answers them in order: a token that keeps the epoch confirms the
    oldest (chained, held whole); any other ends them all (the first was cut short,
    or was not chained), and the steps after it are dropped on every stage. A chained
    step promises the step after it; when the pipeline is full that one waits in
    :attr:`successor` until a confirmation makes room."""

    def __init__(self) -> None:
        self.steps: collections.deque[Step] = collections.deque()
        #: ``(token, pos)`` of the step the newest chained one promised, not sent yet.
        self.successor: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.steps)

    def sent(self, step: Step) -> None:
        """``step`` went out (after every step in flight)."""
        self.steps.append(step)

    def confirm(self, pos: int) -> Step | None:
        """The oldest step, if the token for ``pos`` confirms it (chained, its next
        step fed at ``pos``); None otherwise (nothing changes)."""
        first = self.steps[0] if self.steps else None
        if first is not None and first.chained and first.pos + first.k == pos:
            return self.steps.popleft()
        return None

    def restart(self) -> Step | None:
        """Forget every step in flight; the oldest (the one the restarting token
        came from), if any."""
        first = self.steps[0] if self.steps else None
        self.steps.clear()
        self.successor = None
        return first

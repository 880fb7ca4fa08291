"""Stage 0's side of speculative decoding: each token fed back starts a step, with a
draft after it when the request speculates (prompt lookup, or a draft model's
proposal), and over a split steps are chained: the next drafted step goes before the
last one comes back, as many in flight as there are stages.

The last stage's side (verifying a draft row by row) is in :mod:`.output`."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from meshd.engines.draft_model import DraftClient
from meshd.engines.drafting import MAX_NGRAM, MIN_NGRAM, DraftBudget, Step, prompt_lookup
from meshd.engines.protocol import RunnerConfig
from meshd.transport import wire

from .state import Request, Work


class Speculation:
    """Steps of stage 0's requests: fed, drafted, chained, and timed for each
    request's :class:`DraftBudget`. Queued work goes to ``queue``."""

    def __init__(
        self,
        cfg: RunnerConfig,
        n_ctx: int,
        n_vocab: int,
        drafts: DraftClient,
        queue: Callable[[Work], None],
    ) -> None:
        self.draft_max = cfg.draft_max
        #: Steps of one request in flight at once: one a stage keeps every stage of a
        #: split busy; one stage has nothing to overlap.
        self.chain_depth = cfg.n_stages
        self.n_ctx = n_ctx
        self.n_vocab = n_vocab
        self.drafts = drafts
        self.queue = queue

    def start(self, r: Request) -> None:
        """Let ``r`` draft: a budget, and its tokens shown to the draft model."""
        assert r.tokens is not None  # a generating request at stage 0
        r.budget = DraftBudget(self.draft_max)
        self.drafts.prime(r.req, r.tokens, r.route[0])

    def on_token(self, r: Request, t: wire.Token) -> None:
        """The last stage's word on ``r``'s oldest step in flight."""
        step = r.flight.confirm(t.pos) if t.epoch == r.epoch else None
        if step is None:
            r.epoch = t.epoch
            self.feed(r, t.token, t.pos)
            return
        self._timed(r, step, step.k, bonus=False)
        if r.flight.successor is not None and len(r.flight) < self.chain_depth:
            token, pos = r.flight.successor
            r.flight.successor = None
            self._launch(r, token, pos)

    def feed(self, r: Request, token: int, pos: int) -> None:
        """Queue ``token`` at ``pos``: every step sent before is over (any left queued
        here is dropped unrun, as the last stage drops any on its way)."""
        if r.tokens is not None:
            del r.tokens[pos:]  # a rejected draft's tokens
            self.drafts.truncated(r.req, pos)
            if len(r.tokens) == pos:
                r.tokens.append(token)
        step = r.flight.restart()
        self._timed(r, step, pos - step.pos - 1 if step is not None else 0)
        self._launch(r, token, pos)

    def on_proposal(self, r: Request | None, p: wire.Proposal) -> None:
        """A draft model's answer: the step of ``r`` that waited for it runs now."""
        got = self.drafts.answer(p)
        if got is None or r is None:
            return
        pend, draft = got
        # A draft model padded to more embedding rows may name ids past this model's
        # (never trained, never likely): the draft ends before the first such one.
        cut = next((i for i, t in enumerate(draft) if not 0 <= t < self.n_vocab), len(draft))
        draft = draft[: min(cut, max(0, self.n_ctx - pend.pos - 2))]
        self.drafts.truncated(r.req, pend.pos + 1 + len(draft))
        # Asked and waited for, none given: timed as a draft that failed.
        self._queue_step(r, pend.token, pend.pos, draft, wire.DRAFT_BY_MODEL, asked=pend.k)

    def run_undrafted(self, reqs: dict[str, Request], now: float) -> None:
        """Queue without a draft the steps whose proposal did not come in time."""
        for req, pend in self.drafts.overdue(now):
            r = reqs.get(req)
            if r is not None:
                # Timed as a draft none of which held: the budget stops asking a draft
                # model that does not answer in time, as one whose drafts fail.
                self._queue_step(r, pend.token, pend.pos, [], asked=pend.k)

    def _timed(self, r: Request, step: Step | None, held: int, bonus: bool = True) -> None:
        """Tell ``r``'s draft budget how ``step`` fared (None: no step was in
        flight), timed from the token before: ``held`` of its draft held, and
        ``bonus``, a token after them came back (a restart)."""
        b = r.budget
        if b is None:
            return
        now = time.perf_counter()
        took = now - r.fed_at if r.fed_at else 0.0
        r.fed_at = now
        if step is not None and step.k:
            b.record(step.k, max(0, min(step.k, held)), took, bonus)
        elif took:
            b.plain(took)

    def _launch(self, r: Request, token: int, pos: int) -> None:
        """Send the step feeding ``token`` at ``pos`` (its KV joins what ``r``
        holds), with a draft after it when the request speculates: from its own text,
        else from the draft model (then the step waits for the proposal). Over a split
        a step with a whole lookup draft is chained, and the step after it follows
        while there is room in flight."""
        b = r.budget
        draft: list[int] = []
        k = min(b.k, self.n_ctx - pos - 2) if b is not None else 0
        # A chained step's draft names one token more: the next step's first.
        extra = 1 if self.chain_depth > 1 and k > 0 else 0
        if b is not None and b.on and r.tokens is not None and len(r.tokens) == pos + 1:
            # With a draft model to ask, only the surest lookups (the longest n-gram
            # found again: text being quoted) go before it.
            model = self.drafts.usable(r.req)
            draft = prompt_lookup(r.tokens, k + extra, MAX_NGRAM if model else MIN_NGRAM)
            if not draft and k > 0 and model and not r.flight:
                wait = self.drafts.wait_s(b.plain_s)
                self.drafts.ask(r.req, r.tokens, k, r.route[0], wait)
                return  # on_proposal (or run_undrafted) queues the step
        chained = extra == 1 and len(draft) == k + 1
        self._queue_step(r, token, pos, draft, wire.DRAFT_BY_LOOKUP, chained=chained)
        if not chained:
            return
        if len(r.flight) < self.chain_depth:
            self._launch(r, draft[-1], pos + k + 1)
        else:
            r.flight.successor = (draft[-1], pos + k + 1)

    def _queue_step(
        self,
        r: Request,
        token: int,
        pos: int,
        draft: list[int],
        by: str = "",
        chained: bool = False,
        asked: int = 0,
    ) -> None:
        """Queue the step feeding ``token`` at ``pos``, and ``draft`` (written by
        ``by``) after it; ``chained``: the draft's last token is the next step's
        first, not a row of this one. ``asked``: tokens asked of a draft model that
        gave none (the budget counts them as a draft that failed)."""
        if draft:
            assert r.tokens is not None
            r.tokens += draft
            r.spec = True
        rows = draft[:-1] if chained else draft
        tokens = np.array([token, *rows], np.int32)
        r.flight.sent(Step(pos, len(draft) or asked, chained))
        self.queue(Work(r.req, pos, tokens=tokens, draft=draft,
                        draft_by=by if draft else "", epoch=r.epoch))  # fmt: skip

"""Drafts from a small model that shares the target's vocabulary (speculative decoding).

Prompt lookup (``meshd.engines.drafting``) drafts only where a request repeats its own
text. A draft model drafts anywhere: a model several times smaller than the target,
with the same tokens, writes the next few tokens the way the target probably would.
It is an instance of its own (one whole-model stage on any node, placed like any
model); the node picks it for a target by capability (``meshd.placement.drafts``) and
tells the target's stage 0 where its runner is (``SetDraft``). Two sides, each inside a
runner process, talk over the runners' own ROUTER sockets:

* :class:`DraftClient`, in stage 0 of the target: for a request whose turn it is to
  draft, it sends a :class:`~meshd.transport.wire.Propose` with the tokens the draft
  runner has not seen yet and waits for the :class:`~meshd.transport.wire.Proposal`, at
  most a few plain steps' time (then the step runs without a draft: a slow or gone
  draft model never stalls a request). At admission it sends the prompt alone, so the
  first proposal does not wait for the draft model's prefill.
* :class:`DraftServer`, in the draft model's runner: one KV sequence per request it
  drafts for, synced to what stage 0 sent (truncated where stage 0 dropped a rejected
  draft), and every waiting request's next token computed in one engine call, ``k``
  rounds for ``k`` tokens (greedy: a draft is one token for sure, which the verifying
  stage keeps under the rejection rule).

What the draft runner holds is tracked by count only: stage 0 sends one ask at a time
per request, and ZeroMQ keeps one sender's messages in order, so a count from the
answer to the latest ask, lowered when stage 0 drops tokens, always names positions
both sides agree on.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from meshd.transport import wire

from .stage import StageInput

__all__ = ["DraftClient", "DraftServer"]

log = logging.getLogger(__name__)

#: Shortest wait for a proposal; otherwise a few plain steps (see DraftClient.wait_s).
MIN_WAIT_S = 0.05
WAIT_STEPS = 4
#: Longest, whatever the steps take.
MAX_WAIT_S = 1.0


@dataclass
class Pending:
    """A step held back for a draft of ``k`` tokens: the token to feed at ``pos``, and
    until when it waits."""

    token: int
    pos: int
    k: int
    deadline: float


class DraftClient:
    """Stage 0's side: asks the draft model's runner for drafts (see the module doc)."""

    def __init__(self, target: str, send: Callable[[wire.Addr, wire.Message], None]) -> None:
        self.target = target
        self.send = send
        self.instance: str | None = None
        self.addr: wire.Addr | None = None
        #: Request -> how many of its tokens the draft runner holds as stage 0 has them.
        self.held: dict[str, int] = {}
        self.pending: dict[str, Pending] = {}
        #: Requests the draft model cannot serve (its context is too short for them).
        self.refused: set[str] = set()

    def set(self, instance: str | None, addr: wire.Addr | None) -> None:
        """Use the draft model ``instance`` at ``addr`` from now on (None: none)."""
        if (instance, addr) == (self.instance, self.addr):
            return
        # The old one frees what it held; the new one holds nothing. Steps waiting
        # for the old one's answer wait on (it may still come, else they time out).
        for req in list(self.held):
            self._release(req)
        self.refused.clear()
        self.instance, self.addr = (instance, addr) if instance and addr else (None, None)
        log.info("draft model for %s: %s", self.target, self.instance or "none")

    def usable(self, req: str) -> bool:
        """Whether ``req`` may ask for a draft now."""
        return self.addr is not None and req not in self.refused and req not in self.pending

    def prime(self, req: str, tokens: Sequence[int], reply_to: wire.Addr) -> None:
        """Send a new request's prompt ahead, so its first proposal only computes the
        draft (``k`` 0: nothing is proposed, nothing is waited for)."""
        if self.addr is None or not tokens:
            return
        self.held[req] = 0
        self._ask(req, 0, tokens, 0, reply_to)

    def ask(
        self, req: str, tokens: Sequence[int], k: int, reply_to: wire.Addr, wait_s: float
    ) -> None:
        """Ask for ``k`` tokens after ``tokens`` (the request's, its newest last, to be
        fed at ``len(tokens) - 1``); the step waits in :attr:`pending` for
        :meth:`answer` or until :meth:`overdue` gives it up."""
        assert self.addr is not None
        held = min(self.held.get(req, 0), len(tokens) - 1)
        self.held[req] = held
        self._ask(req, held, tokens[held:], k, reply_to)
        pos = len(tokens) - 1
        self.pending[req] = Pending(tokens[-1], pos, k, time.monotonic() + wait_s)

    def _ask(self, req: str, pos: int, tokens: Sequence[int], k: int, to: wire.Addr) -> None:
        assert self.instance is not None and self.addr is not None
        self.send(
            self.addr,
            wire.Propose(req=req, instance=self.instance, target=self.target, pos=pos,
                         tokens=[int(t) for t in tokens], k=k, reply_to=to),
        )  # fmt: skip

    def answer(self, p: wire.Proposal) -> tuple[Pending, list[int]] | None:
        """The step waiting for ``p`` and its draft; None when none waits for it (it
        came too late, or answers a prime). Only the answer to the latest ask says
        what the draft runner holds."""
        pend = self.pending.get(p.req)
        if p.held < 0:
            self.refused.add(p.req)
        if pend is None or p.pos != pend.pos + 1:
            if pend is None and p.req in self.held and p.held >= 0 and not p.draft:
                self.held[p.req] = p.held  # a prime's answer: nothing was asked since
            return None
        del self.pending[p.req]
        self.held[p.req] = max(0, p.held)
        return pend, list(p.draft)

    def truncated(self, req: str, n: int) -> None:
        """Stage 0 dropped the request's tokens from ``n`` on (a rejected draft)."""
        if req in self.held:
            self.held[req] = min(self.held[req], n)

    def overdue(self, now: float) -> list[tuple[str, Pending]]:
        """The steps whose draft did not come in time: they run without one."""
        late = [(req, p) for req, p in self.pending.items() if p.deadline <= now]
        for req, _ in late:
            del self.pending[req]
        return late

    def next_deadline(self) -> float | None:
        """When the earliest waiting step gives up its draft (None: none waits)."""
        return min((p.deadline for p in self.pending.values()), default=None)

    def forget(self, req: str) -> None:
        """The request ended here: the draft runner frees its sequence."""
        self.pending.pop(req, None)
        self.refused.discard(req)
        self._release(req)

    def _release(self, req: str) -> None:
        if self.held.pop(req, None) is not None and self.addr is not None:
            assert self.instance is not None
            self.send(self.addr, wire.Release(req=req, instance=self.instance, reason="cancel"))

    @staticmethod
    def wait_s(plain_s: float) -> float:
        """How long a step waits for its draft: a few plain steps, within bounds."""
        return min(MAX_WAIT_S, max(MIN_WAIT_S, WAIT_STEPS * plain_s))


@dataclass
class _Held:
    seq: int
    n: int = 0
    last_active: float = field(default_factory=time.monotonic)


class DraftServer:
    """The draft model's side: keeps one sequence per request it drafts for and
    answers every waiting :class:`~meshd.transport.wire.Propose` in batched rounds."""

    def __init__(
        self,
        stage,
        n_ctx: int,
        take_seq: Callable[[], int | None],
        give_seq: Callable[[int], None],
        send: Callable[[wire.Addr, wire.Message], None],
    ) -> None:
        self.stage = stage
        self.n_ctx = n_ctx
        self.take_seq = take_seq
        self.give_seq = give_seq
        self.send = send
        self.held: collections.OrderedDict[str, _Held] = collections.OrderedDict()
        self.asks: dict[str, wire.Propose] = {}
        #: Tokens drafted so far; what was last reported of it, and when.
        self.proposed = 0
        self._reported = (0, 0.0)

    def ask(self, p: wire.Propose) -> None:
        """Queue ``p`` for the next :meth:`run` (a newer ask of a request replaces its
        older one: stage 0 has moved on)."""
        self.asks[p.req] = p

    def run(self) -> None:
        """Answer every queued ask: sync each sequence, then draft in rounds."""
        asks, self.asks = list(self.asks.values()), {}
        work: list[tuple[wire.Propose, _Held]] = []
        for p in asks:
            try:
                h = self._sync(p)
            except Exception as e:  # an engine that cannot roll back, a bad ask
                log.info("cannot draft for %s: %s", p.req, e)
                self.release(p.req)
                self._reply(p, [], -1)
                continue
            if h is not None:
                work.append((p, h))
        if not work:
            return
        drafts: dict[str, list[int]] = {p.req: [] for p, _ in work}
        items = [StageInput(seq=h.seq, pos=p.pos, tokens=np.asarray(p.tokens, np.int32))
                 for p, h in work]  # fmt: skip
        live = work
        while live:
            outs = self._forward(live, items)
            nxt: list[tuple[wire.Propose, _Held]] = []
            nxt_items: list[StageInput] = []
            for (p, h), it, out in zip(live, items, outs, strict=True):
                if out is None:
                    continue
                h.n = it.pos + it.n_rows
                d = drafts[p.req]
                if p.k <= 0:
                    continue
                d.append(int(np.argmax(out)))
                if len(d) < p.k:
                    nxt.append((p, h))
                    nxt_items.append(StageInput(seq=h.seq, pos=h.n,
                                                tokens=np.asarray(d[-1:], np.int32)))  # fmt: skip
            live, items = nxt, nxt_items
        for p, h in work:
            if p.req not in self.held:
                continue  # failed above
            h.last_active = time.monotonic()
            d = drafts[p.req]
            self.proposed += len(d)
            self._reply(p, d, h.n)

    def report(self, emit: Callable[[], None], every: float = 1.0) -> None:
        """Call ``emit`` (which reports :attr:`proposed`) when it changed, at most
        every ``every`` s (the runner's loop calls this at least every 200 ms)."""
        now = time.monotonic()
        if self.proposed != self._reported[0] and now - self._reported[1] >= every:
            self._reported = (self.proposed, now)
            emit()

    def _sync(self, p: wire.Propose) -> _Held | None:
        """The request's sequence, holding its first ``p.pos`` tokens; None (answered
        already) when it cannot draft now."""
        h = self.held.get(p.req)
        if p.pos + len(p.tokens) + max(0, p.k - 1) > self.n_ctx:
            self.release(p.req)
            self._reply(p, [], -1)  # never will: its context outgrows this one
            return None
        if h is None:
            seq = self.take_seq()
            if seq is None:
                self._reply(p, [], 0)  # no room now: the request asks again later
                return None
            h = self.held[p.req] = _Held(seq)
        self.held.move_to_end(p.req)
        if p.pos > h.n or not p.tokens:
            # It lost what stage 0 counts on (freed, expired, restarted): start over.
            self.stage.free(h.seq)
            h.n = 0
            self._reply(p, [], 0)
            return None
        if p.pos < h.n:
            self.stage.truncate(h.seq, p.pos)
            h.n = p.pos
        return h

    def _forward(self, work: list[tuple[wire.Propose, _Held]], items: list[StageInput]) -> list:
        try:
            return self.stage.forward(items)
        except Exception:
            outs = []
            for (p, _), it in zip(work, items, strict=True):
                try:
                    outs.append(self.stage.forward([it])[0])
                except Exception as e:
                    log.info("draft for %s failed: %s", p.req, e)
                    self.release(p.req)
                    self._reply(p, [], 0)
                    outs.append(None)
            return outs

    def _reply(self, p: wire.Propose, draft: list[int], held: int) -> None:
        pos = p.pos + len(p.tokens)
        msg = wire.Proposal(req=p.req, instance=p.target, pos=pos, draft=draft, held=held)
        self.send(p.reply_to, msg)

    def release(self, req: str) -> bool:
        """Free ``req``'s sequence; False when it holds none here."""
        self.asks.pop(req, None)
        h = self.held.pop(req, None)
        if h is None:
            return False
        self.stage.free(h.seq)
        self.give_seq(h.seq)
        return True

    def release_oldest(self) -> bool:
        """Free the sequence of the request drafted for least recently; False if none."""
        return bool(self.held) and self.release(next(iter(self.held)))

    def expire(self, now: float, after: float) -> None:
        """Free the sequences of requests not heard from for ``after`` seconds (their
        stage 0 is gone, or its release was lost)."""
        for req in [r for r, h in self.held.items() if now - h.last_active > after]:
            self.release(req)

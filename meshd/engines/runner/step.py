"""The batched step: one engine call over every request that has work queued (one
item each), so several streams keep every stage busy. Prompt steps another request
just ran are shared instead of run again (see :mod:`.prefills`).

The step computes; the loop sends what each result means (:class:`Done`)."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from meshd.engines.calibrate import LayerClock
from meshd.engines.protocol import RunnerConfig
from meshd.engines.stage import Stage, StageInput, StageInputError

from .chunks import Chunker
from .prefills import Prefills, step_key
from .seats import Seats
from .state import Counters, Request, Work

log = logging.getLogger("meshd.runner")


@dataclass
class Done:
    """One request's step: its output (None when the engine refused its input:
    ``error`` says why) and the compute seconds of the call that made it."""

    work: Work
    out: np.ndarray | None
    spent: float
    error: str = ""


@dataclass
class Ran:
    """A step's results: the items run (in order), the followers whose prompt step
    another item ran (see :meth:`Stepper.follow`), and whether the decode figure
    moved enough to report."""

    done: list[Done]
    followers: list[tuple[Work, bytes]]
    news: bool = False
    #: Compute seconds of the call (a follower run alone is counted at the same).
    spent: float = 0.0


def group_size(n_held: int, n_groups: int) -> int | None:
    """Most requests one step takes when the ``n_held`` requests are stepped in
    ``n_groups`` micro-batches (None: every one with work).

    Stage 0 of a split steps its requests in as many groups as there are stages: while the
    next stage runs the rows of one group, stage 0 runs another's, so every stage
    works at once (one batch of all of them would leave each stage idle while the
    others run it). The groups form by themselves: a group's tokens come back
    together, and that work is what the next step takes. A lone request is never
    held back (a group of one); the later stages step what arrives, whole."""
    if n_groups < 2:
        return None
    return max(1, -(-n_held // n_groups))


def take_batch(
    work: collections.deque[Work],
    reqs: dict[str, Request],
    restarts: bool,
    counters: Counters,
    cap: int | None = None,
) -> list[Work]:
    """Take the next step's items from ``work`` (one per request, oldest first, at
    most ``cap`` of them; the rest stay queued). Work of a released request is
    dropped; with ``restarts`` (stage 0 and the last stage, which know each request's
    epoch), so is work sent before a restart of its request."""
    batch: list[Work] = []
    seen: set[str] = set()
    rest: list[Work] = []
    while work:
        w = work.popleft()
        r = reqs.get(w.req)
        if r is None:
            continue  # released while queued
        if w.epoch != r.epoch and restarts:
            counters.stale_steps += 1  # sent before its request restarted
            continue
        if w.req in seen or (cap is not None and len(batch) >= cap):
            rest.append(w)
        else:
            seen.add(w.req)
            batch.append(w)
    work.extend(rest)
    return batch


class Stepper:
    """Runs a batch through the stage."""

    def __init__(
        self, stage: Stage, seats: Seats, clock: LayerClock, counters: Counters, cfg: RunnerConfig
    ) -> None:
        self.stage = stage
        self.seats = seats
        self.clock = clock
        self.counters = counters
        first = cfg.stage == 0
        self.last = cfg.stage == cfg.n_stages - 1
        #: Stage 0 and the last stage know each request's epoch (see :func:`take_batch`).
        self.restarts = first or self.last
        self.n_groups = cfg.n_stages if first else 1
        self.prefills = Prefills()
        #: Stage 0 cuts prompts into chunks (see :mod:`.chunks`), paced by the steps here.
        self.chunker = Chunker(int(getattr(stage, "n_batch", 0)))

    def take(self, work: collections.deque[Work], reqs: dict[str, Request]) -> list[Work]:
        """The next step's items: one per request with work, on stage 0 of a split one
        micro-batch of them (see :func:`group_size`)."""
        cap = group_size(len(reqs), self.n_groups)
        batch = take_batch(work, reqs, self.restarts, self.counters, cap)
        self.counters.widest = max(self.counters.widest, len(batch))
        return batch

    def run(self, batch: list[Work], reqs: dict[str, Request]) -> Ran:
        """Run ``batch``: each prompt step once (the n choices of one prompt bring
        the same steps), the others left to :meth:`follow`."""
        run: list[tuple[Work, bytes | None]] = []
        followers: list[tuple[Work, bytes]] = []
        leading: set[bytes] = set()
        parted = [self.run_parts(reqs[w.req], w) for w in batch if w.parts is not None]
        batch = [w for w in batch if w.parts is None]
        for w in batch:
            # A recurrent state is shared whole or not at all: each choice runs its own.
            k = None if self.stage.recurrent else step_key(reqs[w.req], w)
            if k is not None and (k in leading or self.prefills.live(k, reqs) is not None):
                followers.append((w, k))
            else:
                run.append((w, k))
                if k is not None:
                    leading.add(k)
        if not run:
            return Ran(parted, followers)
        items = [self.item(reqs[w.req], w) for w, _ in run]
        rows = [it.n_rows for it in items]
        if prompts := sum(w.pos < reqs[w.req].n_prompt for w, _ in run):
            self.counters.prefilled(prompts)
        self.seats.count_rows(sum(rows))
        t0 = time.perf_counter()
        news = False
        try:
            outs = self.stage.forward(items)
        except Exception:
            # One bad item fails the whole call: run them one by one so only the
            # requests at fault end (with a typed error), and the runner lives on.
            done = [self.forward_one(w, it) for (w, _), it in zip(run, items, strict=True)]
        else:
            self.clock.record(time.perf_counter() - t0, rows)
            self.chunker.pace.record(sum(rows), time.perf_counter() - t0)
            news = self.clock.news(t0)
            done = [Done(w, out, 0.0) for (w, _), out in zip(run, outs, strict=True)]
        spent = round(time.perf_counter() - t0, 6)
        self.counters.busy_s += spent
        for d, (w, k) in zip(done, run, strict=True):
            d.spent = spent
            if d.out is None:
                continue
            reqs[w.req].lineage = k
            if k is not None:
                self.prefills.remember(k, w.req, w.pos + w.rows, d.out)
        return Ran(parted + done, followers, news, spent)

    def run_parts(self, r: Request, w: Work) -> Done:
        """A prompt with images at stage 0: its token runs and image rows through the
        engine in order (it takes one kind a call), the rows out as one step's."""
        assert w.parts is not None
        t0 = time.perf_counter()
        outs, pos = [], w.pos
        try:
            for part in w.parts:
                rows = part if part.ndim == 2 else None
                item = StageInput(
                    r.seq, pos, tokens=None if rows is not None else part, hidden=rows
                )
                outs.append(self.stage.forward([item])[0])
                pos += len(part)
        except Exception as e:
            log.warning("request %s failed at this stage: %s", w.req, e, extra={"req": w.req})
            self.stage.truncate(r.seq, w.pos)
            return Done(w, None, 0.0, error=str(e))
        out = outs[-1] if self.last else np.concatenate(outs)
        r.lineage = None
        return Done(w, out, round(time.perf_counter() - t0, 6))

    def follow(self, ran: Ran, reqs: dict[str, Request]) -> Iterator[Done]:
        """The followers' steps, one at a time (the loop sends each result before the
        next is taken): the leader's KV shared and its output given, else run alone."""
        for w, k in ran.followers:
            p = self.prefills.live(k, reqs)
            r = reqs.get(w.req)
            if r is None:
                continue
            try:
                if p is None:
                    raise StageInputError("its prefill is gone")
                holder = next(h for h in p.holders if h in reqs)
                if w.pos:  # it holds the leader's first w.pos already: take all again
                    self.stage.free(r.seq)
                self.stage.share(reqs[holder].seq, r.seq, p.n)
                r.lineage = k
            except Exception:
                r.lineage = None
                item = StageInput(seq=r.seq, pos=w.pos, tokens=w.tokens, hidden=w.hidden)
                done = self.forward_one(w, item)
                done.spent = ran.spent
                yield done
                continue
            self.counters.shared_prefills += 1
            p.holders.append(r.req)
            yield Done(w, p.out, 0.0)

    def item(self, r: Request, w: Work) -> StageInput:
        """The engine's input for ``w``. A speculating request's step may start before
        what this stage holds (rows of a rejected draft): those are dropped first."""
        if r.spec and self.stage.n_past(r.seq) > w.pos:
            self.stage.truncate(r.seq, w.pos)
        # A row's logits for each drafted token, and for the one after them unless
        # the step is chained (then that is the next step's row).
        n_logits = min(len(w.draft) + 1, w.rows) if self.last and w.draft else 1
        return StageInput(r.seq, w.pos, tokens=w.tokens, hidden=w.hidden, n_logits=n_logits)

    def forward_one(self, w: Work, item: StageInput) -> Done:
        """One item alone; a failure is the request's (``error``), not the runner's."""
        try:
            return Done(w, self.stage.forward([item])[0], 0.0)
        except Exception as e:
            log.warning("request %s failed at this stage: %s", w.req, e, extra={"req": w.req})
            return Done(w, None, 0.0, error=str(e))

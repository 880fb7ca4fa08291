"""KV seats: which engine sequence each request holds, and the prefix cache of
finished requests' KV kept for a later request that begins the same way.

Stage 0 knows the tokens and chooses (:meth:`Seats.seat_first`); every later stage
follows its word (:meth:`Seats.seat`), so a prefix is taken from the same slot on
every stage. Kept KV is not free, but any admission may take it back (least recently
used first), and it ages out once other work has run past what recomputing it costs.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from meshd.engines.stage import Stage, StageInputError
from meshd.transport import wire

from .state import Counters, Refused

if TYPE_CHECKING:
    from meshd.engines.draft_model import DraftServer

#: Fewest positions worth taking from the prefix cache: below it a request computes
#: its whole prompt (a few rows cost less than disturbing a cached sequence).
MIN_PREFIX = 8


@dataclass
class Kept:
    """A finished request's KV, kept on its sequence for a later request whose tokens
    begin the same way. Stage 0 knows the tokens; the other stages follow its word."""

    seq: int
    tokens: list[int] | None = None
    #: The stage's :attr:`Seats.rows_run` when it was kept or last reused.
    rows_at: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


class Seats:
    """The stage's sequences: free, held by a request, or kept for a prefix."""

    def __init__(
        self, stage: Stage, n_seq_max: int, kept_rows: int | None, counters: Counters
    ) -> None:
        self.stage = stage
        self.counters = counters
        self.free = list(range(n_seq_max - 1, -1, -1))
        #: The prefix cache: finished requests' KV by stage 0's slot, least recently
        #: used first. A kept sequence is not free, but any admission may take it.
        self.kept: collections.OrderedDict[int, Kept] = collections.OrderedDict()
        #: Rows this stage has computed, the clock kept prefixes age by.
        self.rows_run = 0
        #: Rows of other work a kept prefix survives (None: only room evicts it).
        self.kept_rows = kept_rows
        #: A whole-model stage drafting for other models holds sequences too: the
        #: last to give one back when this model's own requests need it.
        self.drafting: DraftServer | None = None

    def has_room(self) -> bool:
        """Whether a new request can have a sequence (a free one, a kept one, or one
        drafting for another model)."""
        return bool(self.free or self.kept or (self.drafting and self.drafting.held))

    def give_back(self, seq: int) -> None:
        """Free ``seq``'s KV; the sequence is free again."""
        self.stage.free(seq)
        self.free.append(seq)

    def count_rows(self, n: int) -> None:
        """``n`` more rows ran: kept prefixes age by them."""
        self.rows_run += n
        self.age()

    # -- the prefix cache --------------------------------------------------------------
    def keep(self, slot: int, seq: int, tokens: list[int] | None, n_kv: int = -1) -> None:
        """Keep ``seq``'s KV under ``slot`` for a later request with the same start:
        its first ``n_kv`` positions (-1: all it holds); ``tokens``: what it holds.
        A recurrent stage keeps nothing: its state cannot be cut back to serve a
        later request (see meshd.domain.recurrent)."""
        if self.stage.recurrent:
            self.give_back(seq)
            return
        n = self.stage.n_past(seq)
        if 0 <= n_kv < n:
            # Rows past the answer's last token: every stage keeps the same positions
            # (a stage that ran a chained step the last stage dropped holds more).
            self.stage.truncate(seq, n_kv)
            n = n_kv
        if tokens is not None:
            # What the sequence holds: the last token sampled was never fed.
            tokens = tokens[:n]
        if slot in self.kept:  # cannot happen unless stage 0 reused a live slot
            self.drop_kept(slot)
        self.kept[slot] = Kept(seq, tokens, self.rows_run)

    def drop_kept(self, slot: int) -> None:
        """Forget the KV kept under ``slot``; its sequence is free again."""
        self.give_back(self.kept.pop(slot).seq)

    def age(self) -> None:
        """Drop the prefixes kept unused for more rows than they are worth
        (``Stage.kept_rows``): least recently used first."""
        while self.kept and self.kept_rows is not None:
            slot, k = next(iter(self.kept.items()))
            if self.rows_run - k.rows_at <= self.kept_rows:
                return
            self.drop_kept(slot)
            self.counters.prefixes_aged += 1

    def drop_all_kept(self) -> None:
        """Forget every kept prefix (a cold request, a new plan)."""
        for slot in list(self.kept):
            self.drop_kept(slot)

    def take(self) -> int | None:
        """A free sequence for a draft, a kept prefix given up for it if need be;
        None when every sequence serves a request."""
        if not self.free:
            self._free_one(spare=-1, drafts=False)
        return self.free.pop() if self.free else None

    def _free_one(self, spare: int, drafts: bool = True) -> bool:
        """Free the least recently used kept sequence but ``spare``'s, else (with
        ``drafts``) the one drafting for the least recent other model's request: this
        model's own requests come first. False if none."""
        victim = next((slot for slot in self.kept if slot != spare), None)
        if victim is not None:
            self.drop_kept(victim)
            return True
        ds = self.drafting
        return drafts and ds is not None and ds.release_oldest()

    # -- seating a request -------------------------------------------------------------
    def seat_first(self, prompt: list[int] | None) -> tuple[int, int, int]:
        """Stage 0: a sequence for a new request whose prompt is ``prompt`` (None:
        no prefix reuse), as ``(seq, source slot or -1, positions reused)``.

        The kept sequence sharing the longest start with the prompt is its source:
        copied into a free sequence when there is one (it stays kept for the next
        request), else taken over. At least the prompt's last token is computed again,
        for its logits."""
        source, n = -1, 0
        if prompt is not None:
            for slot, k in self.kept.items():  # oldest first: ties go to the newest
                m = min(common_prefix(k.tokens or [], prompt), len(prompt) - 1)
                if m >= MIN_PREFIX and m >= n:
                    source, n = slot, m
        if not self.free:
            self._free_one(spare=source)
        # With no free sequence left, the source itself becomes the request's.
        seq = self.free.pop() if self.free else self.kept.pop(source).seq
        if source >= 0:
            self._reuse(source, seq, n)
        return seq, source, n

    def seat(self, s: wire.Start) -> int:
        """A later stage: the sequence for a new request, prefix copied as stage 0
        said. :class:`Refused` when this stage cannot: ``prefix_miss`` (stage 0 must
        forget that prefix) or ``overloaded``."""
        if s.cold:
            self.drop_all_kept()
        if s.slot in self.kept and s.slot != s.prefix_slot:
            self.drop_kept(s.slot)  # stage 0 gave that slot to this request
        if s.prefix_slot >= 0 and s.prefix_slot not in self.kept:
            raise Refused("prefix_miss", "no longer holds the cached prefix")
        if not self.free and s.prefix_slot != s.slot:
            self._free_one(spare=s.prefix_slot)
        if s.prefix_slot >= 0 and (s.prefix_slot == s.slot or not self.free):
            # Taken over: stage 0 said so, or this stage has fewer sequences than it
            # (stage 0 still counts on the prefix; a miss later tells it otherwise).
            seq = self.kept.pop(s.prefix_slot).seq
        elif self.free:
            seq = self.free.pop()
        else:
            raise Refused("overloaded", "stage has no free sequence")
        if s.prefix_slot >= 0:
            try:
                self._reuse(s.prefix_slot, seq, s.prefix_n)
            except StageInputError as e:
                self.give_back(seq)
                raise Refused("prefix_miss", str(e)) from e
        return seq

    def _reuse(self, source: int, seq: int, n: int) -> None:
        """Make ``seq`` hold the first ``n`` positions kept under slot ``source``
        (``seq`` is that very sequence when the request took it over)."""
        k = self.kept.get(source)
        if k is None:
            self.stage.truncate(seq, n)
        else:
            self.stage.share(k.seq, seq, n)
            self.kept.move_to_end(source)
            k.rows_at = self.rows_run
        self.counters.prefix_hits += 1
        self.counters.prefix_tokens += n

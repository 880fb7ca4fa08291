"""Stage 0's queue of requests waiting for a KV sequence: fair across clients, and
each waiting request told its place.

A request's client (``Job.client``: an API key, else an address, as its API node saw
it) decides its turn, not its arrival alone: a client's i-th waiting request ranks
``seated + i``, ``seated`` being how many of that client's requests hold a sequence
now; among equals, the client whose last turn is the oldest goes first, then arrival.
So the next free sequence goes to the client with least in service: one client's
sixty requests do not hold back another's one, and each client's own requests keep
their order.

While it waits a request hears its place (``DataChunk.queued``) when it is queued,
when its place changes (at most every :data:`NOTICE_MIN_S`), and at least every
:data:`NOTICE_EVERY_S`: its API node's sign that stage 0 is alive and the queue
moving, so that waiting one's turn is never taken for a stalled pipeline. The
expected start is the place times the measured time between seats coming free.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from meshd.transport import wire

__all__ = ["NOTICE_EVERY_S", "NOTICE_MIN_S", "Notice", "WaitQueue", "fair_order"]

#: A waiting request hears its place at least this often ...
NOTICE_EVERY_S = 2.0
#: ... and, when its place changed, at most this often.
NOTICE_MIN_S = 0.5
#: Weight of the newest interval between two seats coming free in the mean.
_EWMA = 0.2
#: Clients whose last turn is remembered (the least recent are forgotten first).
MAX_CLIENTS = 1024


@dataclass
class Waiter:
    """One waiting request: its Generate, its arrival number and time, and the
    place it was last told (0: none yet) and when."""

    g: wire.Generate
    order: int
    since: float
    told: int = 0
    told_at: float = float("-inf")

    @property
    def client(self) -> str:
        return self.g.job.client


@dataclass(frozen=True)
class Notice:
    """A waiting request's place (1: next) and expected seconds until it starts
    (0: not measured yet)."""

    g: wire.Generate
    place: int
    eta_s: float


def fair_order(
    waiting: Sequence[Waiter], seated: Mapping[str, int], last_turn: Mapping[str, int] = {}
) -> list[Waiter]:
    """``waiting`` in the order they get a sequence (see the module doc): a client's
    i-th waiting request ranks ``seated[client] + i``; ties go to the client whose
    ``last_turn`` (a count of turns given; none: never) is the oldest, then arrival."""
    nth: collections.Counter[str] = collections.Counter()
    ranked = []
    for w in sorted(waiting, key=lambda w: w.order):
        c = w.client
        ranked.append((seated.get(c, 0) + nth[c], last_turn.get(c, -1), w.order, w))
        nth[c] += 1
    ranked.sort(key=lambda r: r[:3])
    return [r[3] for r in ranked]


class WaitQueue:
    """The requests waiting for a sequence on stage 0, at most ``cap`` of them."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._by_req: dict[str, Waiter] = {}
        self._arrivals = 0
        #: Mean seconds between two seats coming free while requests waited (0: none
        #: measured yet), and when the last one came free with the queue not empty.
        self.turnover_s = 0.0
        self._last_take: float | None = None
        #: Turns given so far, and the last one each client had (while any waits).
        self._turns = 0
        self._last_turn: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_req)

    def __iter__(self) -> Iterator[wire.Generate]:
        return (w.g for w in self._by_req.values())

    def full(self) -> bool:
        """Whether one more request would pass the cap."""
        return len(self._by_req) >= self.cap

    def add(self, g: wire.Generate, now: float) -> None:
        """Queue ``g`` (the caller checked :meth:`full`)."""
        self._arrivals += 1
        self._by_req[g.req] = Waiter(g, self._arrivals, now)

    def remove(self, req: str) -> Waiter | None:
        """Take ``req`` out of the queue (a cancel); None when it is not waiting."""
        return self._by_req.pop(req, None)

    def take(self, seated: Mapping[str, int], now: float) -> Waiter | None:
        """The request whose turn it is, out of the queue (None: none waits)."""
        if not self._by_req:
            self._last_take = None
            return None
        w = fair_order(list(self._by_req.values()), seated, self._last_turn)[0]
        del self._by_req[w.g.req]
        self.turn(w.client)
        if self._last_take is not None:
            gap = now - self._last_take
            self.turnover_s = gap if not self.turnover_s else (
                (1 - _EWMA) * self.turnover_s + _EWMA * gap
            )  # fmt: skip
        # The time between two takes measures the queue only while requests wait.
        self._last_take = now if self._by_req else None
        return w

    def turn(self, client: str) -> None:
        """``client`` got a sequence now (from the queue or straight away)."""
        self._turns += 1
        self._last_turn.pop(client, None)
        self._last_turn[client] = self._turns  # newest last: the oldest go first
        if len(self._last_turn) > MAX_CLIENTS:
            del self._last_turn[next(iter(self._last_turn))]

    def drop_generation(self, keep: int) -> list[wire.Generate]:
        """Take out (and return) the requests of any plan generation but ``keep``."""
        gone = [w.g for w in self._by_req.values() if w.g.generation != keep]
        for g in gone:
            del self._by_req[g.req]
        return gone

    def notices(self, seated: Mapping[str, int], now: float) -> list[Notice]:
        """The places due to be told now (see the module doc), marked told."""
        due = []
        order = fair_order(list(self._by_req.values()), seated, self._last_turn)
        for place, w in enumerate(order, 1):
            since = now - w.told_at
            if since >= NOTICE_EVERY_S or (place != w.told and since >= NOTICE_MIN_S):
                w.told, w.told_at = place, now
                due.append(Notice(w.g, place, round(place * self.turnover_s, 2)))
        return due

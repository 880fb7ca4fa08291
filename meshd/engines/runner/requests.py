"""The requests a stage holds, and how each one's hold ends: its KV freed or kept
for the prefix cache, and the release walked on down the chain.

A cancel for a request this stage does not know is fine (it finished, expired, or
its cancel also came another way); the id is remembered so that its first
activation, if still on its way from another sender, is not admitted after it."""

from __future__ import annotations

import collections
import logging
import time

from meshd.engines.draft_model import DraftClient
from meshd.transport import wire

from .links import Links
from .seats import Seats
from .state import Request
from .waiting import WaitQueue

log = logging.getLogger("meshd.runner")

#: Cancelled request ids remembered, so that a request's first activation arriving
#: after its cancel (from another sender, so unordered) is not admitted.
MAX_CANCELLED = 4096


class Requests:
    """The requests holding a sequence here, and stage 0's queue of those waiting
    for one."""

    def __init__(self, seats: Seats, links: Links, drafts: DraftClient, max_waiting: int) -> None:
        self.seats = seats
        self.links = links
        self.drafts = drafts
        self.held: dict[str, Request] = {}
        self.waiting = WaitQueue(max_waiting)
        #: Recently cancelled ids this stage did not hold (oldest first).
        self.cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()

    def release(self, req: str, reason: str, n_kv: int = -1) -> Request | None:
        """End ``req``'s hold here and pass the release down the chain; the request
        (None when it held nothing: its seat is not free for another).

        A request still queued for a slot (stage 0) is dropped from the queue: it was
        never admitted, so no other stage holds it.
        """
        if reason != "done":  # "done": the answer's last chunk is on its way
            self.links.outbox.forget(req)
        r = self.held.pop(req, None)
        if r is None:
            self._release_unheld(req, reason)
            return None
        if reason == "done" and not r.embed:
            self.keep(r, n_kv)
        else:
            if reason == "prefix_miss" and r.source in self.seats.kept:
                self.seats.drop_kept(r.source)
            self.free(r)
        if reason == "prefix_miss":
            reason = "cancel"  # the stages after this one free it like any cancel
        self.links.pass_release(r.route, req, reason, n_kv)
        return r

    def _release_unheld(self, req: str, reason: str) -> None:
        if self.waiting.remove(req) is not None:
            log.info("request %s cancelled while queued", req, extra={"req": req})
            return
        if reason == "cancel":
            self.cancelled[req] = None
            if len(self.cancelled) > MAX_CANCELLED:
                self.cancelled.popitem(last=False)

    def seated(self) -> collections.Counter[str]:
        """How many requests each client has holding a sequence here."""
        return collections.Counter(r.client for r in self.held.values())

    def tell_places(self) -> None:
        """Tell the waiting requests whose notice is due their place (see
        :mod:`.waiting`): their API nodes' sign that the queue is alive."""
        if not self.waiting:
            return
        for n in self.waiting.notices(self.seated(), time.monotonic()):
            self.links.chunk(
                n.g.reply_to, wire.DataChunk(req=n.g.req, queued=n.place, eta_s=n.eta_s)
            )

    def free(self, r: Request) -> None:
        """Give ``r``'s KV slot back here (nothing is sent)."""
        self.held.pop(r.req, None)
        self.drafts.forget(r.req)
        self.seats.give_back(r.seq)

    def keep(self, r: Request, n_kv: int = -1) -> None:
        """Finish ``r`` here, its KV kept for a later request with the same start: its
        first ``n_kv`` positions (-1: all it holds)."""
        self.held.pop(r.req, None)
        self.drafts.forget(r.req)
        self.seats.keep(r.slot, r.seq, r.tokens, n_kv)

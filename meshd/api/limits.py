"""Admission: how many completion requests one node's API carries at once, and whose.

Up to :attr:`Admission.limit` requests are taken whoever sends them; they wait their
turn in their instance's stage 0 queue, which takes turns between clients (see
``meshd.engines.runner.waiting``). Past the limit a request gets a 429 at once, with
a ``Retry-After`` from the rate at which this node's requests have been ending (the
``openai`` client retries 429s by itself), unless its client holds less than its
fair share of the limit: then it is taken anyway, up to :data:`OVER_FAIR` past the
limit (that room shared out between the clients too), so that one client's flood
cannot keep another client out.

A client is its API key when the request carries one other than the node's shared
key (``--api-key``: everyone has that one), else its address.
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
import math
import time

__all__ = [
    "MAX_RETRY_S",
    "OVER_FAIR",
    "RATE_WINDOW_S",
    "Admission",
    "Ticket",
    "client_id",
    "current_client",
    "set_client",
]

#: How far past its limit the node takes requests from clients under their fair share
#: (a fraction of the limit).
OVER_FAIR = 0.25
#: The window over which the rate of ending requests is measured.
RATE_WINDOW_S = 30.0
#: Retry-After when nothing has ended lately, and the most it says.
UNMEASURED_RETRY_S = 5.0
MAX_RETRY_S = 60.0

_CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("meshd_client", default="")


def client_id(api_key: bytes, host: str, shared_key: bytes | None) -> str:
    """Who sends a request: a hash of its API key (never the key itself: the id
    travels to the stages and into logs) unless that is the node's shared key, else
    its address."""
    if api_key and api_key != shared_key:
        return "key:" + hashlib.blake2b(api_key, digest_size=6, person=b"meshd-client").hexdigest()
    return f"ip:{host}" if host else ""


def current_client() -> str:
    """The client of the request being served (set by the access guard)."""
    return _CLIENT.get()


def set_client(client: str) -> contextvars.Token[str]:
    """Make ``client`` the current request's client (see :func:`current_client`)."""
    return _CLIENT.set(client)


class Ticket:
    """One admitted request; :meth:`release` is idempotent."""

    __slots__ = ("_admission", "_client", "_held")

    def __init__(self, admission: Admission, client: str) -> None:
        self._admission = admission
        self._client = client
        self._held = True

    def release(self) -> None:
        """Give the slot back (once; later calls do nothing)."""
        if self._held:
            self._held = False
            self._admission._release(self._client)


class Admission:
    """Requests in flight, by client, with a limit (event-loop confined)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the request limit must be at least 1")
        self.limit = limit
        self.in_flight = 0
        self.by_client: collections.Counter[str] = collections.Counter()
        #: When requests ended (released their slot) over the last RATE_WINDOW_S.
        self._ends: collections.deque[float] = collections.deque()

    def enter(self, client: str = "", now: float | None = None) -> Ticket | None:
        """A ticket for one more request of ``client``, or ``None`` when the node is
        full and the client holds its fair share."""
        if self.in_flight >= self.limit and not self._under_fair_share(client):
            return None
        self.in_flight += 1
        self.by_client[client] += 1
        return Ticket(self, client)

    def _under_fair_share(self, client: str) -> bool:
        """Whether ``client`` may come in past the limit: it holds less than its share
        of the limit, and of the room past it (so that a second client does not take
        all that room from a third)."""
        extra = math.ceil(self.limit * OVER_FAIR)
        if self.in_flight >= self.limit + extra:
            return False
        clients = len(self.by_client) + (client not in self.by_client)
        share = min(self.limit // clients, max(1, extra // clients))
        return self.by_client[client] < share

    def _release(self, client: str, now: float | None = None) -> None:
        self.in_flight -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]
        self._ends.append(time.monotonic() if now is None else now)
        self._trim(self._ends[-1])

    def _trim(self, now: float) -> None:
        while self._ends and self._ends[0] < now - RATE_WINDOW_S:
            self._ends.popleft()

    def retry_after(self, now: float | None = None) -> float:
        """Seconds until a refused request is likely to be taken: the requests past
        the limit over the rate at which requests ended lately (1 to MAX_RETRY_S)."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._ends:
            return UNMEASURED_RETRY_S
        # Intervals between ends over the time they span (a lone end: the time since).
        rate = max(1, len(self._ends) - 1) / max(1.0, now - self._ends[0])
        ahead = max(1, self.in_flight - self.limit + 1)
        return min(MAX_RETRY_S, max(1.0, ahead / rate))

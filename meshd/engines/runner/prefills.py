"""Shared prefills: the ``n`` choices of one prompt bring the same prompt steps to
every stage; each step runs once, and the others take its KV (``Stage.share``) and its
output."""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Container
from dataclasses import dataclass

import numpy as np

from .state import Request, Work

#: Prefills a stage remembers for choices of the same prompt that come after.
MAX_SHARED_PREFILLS = 16
#: Largest output kept for them (hidden rows of a long prompt on a wide model).
MAX_SHARED_OUTPUT = 64 * 1024 * 1024


@dataclass
class Prefill:
    """A prompt step this stage ran: its output, the positions its KV holds after it
    (``n``), and the requests whose KV holds them (the one that ran it, then those
    that shared it), any of which can serve another request with the very same steps
    while it lives."""

    holders: list[str]
    n: int
    out: np.ndarray


def prefill_key(w: Work, lineage: bytes) -> bytes:
    """A digest of a prompt step's input (token ids, or the hidden rows of the stage
    before) and of every step before it (``lineage``: the key of the request's last
    step). Equal keys mean equal KV so far: choices of one prompt give identical bytes
    at every stage, since a shared step sends its leader's very rows on."""
    x = np.ascontiguousarray(w.tokens if w.tokens is not None else w.hidden)
    h = hashlib.blake2b(digest_size=16)
    h.update(lineage)
    h.update(f"{w.pos}{x.dtype.str}{x.shape}".encode())
    h.update(x.data.cast("B"))
    return h.digest()


def step_key(r: Request, w: Work) -> bytes | None:
    """The share key of a prompt step (None for any other: generated tokens differ
    from one choice to the next, and a request started from a cached prefix holds
    KV no other request's lineage vouches for)."""
    if r.lineage is None or r.n_cached or w.pos + w.rows > r.n_prompt or w.parts is not None:
        return None  # (a prompt with images runs for each choice: it is no plain input)
    return prefill_key(w, r.lineage)


class Prefills:
    """The prompt steps this stage ran lately, by key (least recently run first)."""

    def __init__(self) -> None:
        self._by_key: collections.OrderedDict[bytes, Prefill] = collections.OrderedDict()

    def live(self, key: bytes, reqs: Container[str]) -> Prefill | None:
        """The prefill under ``key`` while a request in ``reqs`` still holds its KV."""
        p = self._by_key.get(key)
        if p is None:
            return None
        p.holders = [h for h in p.holders if h in reqs]
        return p if p.holders else None

    def remember(self, key: bytes, holder: str, n: int, out: np.ndarray) -> None:
        """Keep a copy of the step ``holder`` ran (its KV now holds ``n`` positions)
        for the steps with the same key that come after."""
        if out.nbytes > MAX_SHARED_OUTPUT:
            return
        self._by_key[key] = Prefill([holder], n, np.array(out))
        self._by_key.move_to_end(key)
        while len(self._by_key) > MAX_SHARED_PREFILLS:
            self._by_key.popitem(last=False)

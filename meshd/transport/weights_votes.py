"""Which manifest a fetch believes when the holders of a model offer different ones.

Slicing is deterministic: every holder of the file with the placed sha256 cuts the same
bytes for a layer range, so honest holders offer the same manifest root (the sha256 of
its chunk digests). A holder that offers another root holds another file, or lies. The
chunks a fetch pulls are checked against one root; this module says which: the root a
majority of the holders offer, never simply the first one to answer.

Each holder that offers casts one vote (its last offer). The voters are the holders the
cluster lists now, plus any that offered, less those that refused (they do not hold the
file) and those whose root failed verification. A root is taken

- at once when a strict majority of the voters offer it (no other root can outvote it);
- else once every voter has offered, or :attr:`Votes.wait` seconds after the first offer
  (a holder still cutting a slow disk does not hold the fetch up for ever), when it has
  strictly more votes than any other root;
- never on a tie: while holders are still to answer, the fetch waits for them; once
  all have, it cannot tell honest from lying, and fails saying so.

While the count is open, the fetch pulls the root offered most so far (:meth:`Votes.front`,
usually the first to arrive), so holders still cutting do not hold it up: the bytes are
checked against that root as they come, but the slice is kept (renamed into place) only
once the count names its root. The count is taken again at every offer and while the
fetch runs: an offer that makes another root lead switches the fetch to it (it starts
over).

Limits, stated plainly: a lone holder's root is whatever it says (the fetcher checks
what it can against the model's own facts before loading, see ``fetch_slice``'s
``verify``); liars that outnumber the honest holders win; a holder that answers more
than :attr:`Votes.wait` after the first offer may find the slice already kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Offer", "Verdict", "Votes"]

#: What two holders must agree on: (root, size, chunk size).
Offer = tuple[str, int, int]


@dataclass(frozen=True)
class Verdict:
    """The outcome of a count: ``offer`` to fetch (None: not yet, or a tie) and the
    holders that offered it; ``tie`` says who offers what when no root leads."""

    offer: Offer | None = None
    backers: tuple[str, ...] = ()
    tie: str = ""


@dataclass
class Votes:
    """The offers of one slice by holder, counted on demand."""

    #: Seconds after the first offer after which the holders that answered decide.
    wait: float
    offers: dict[str, Offer] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)
    #: Holders whose root failed verification: they vote no more, with why.
    distrusted: dict[str, str] = field(default_factory=dict)
    first: float | None = None

    def offered(self, node: str, offer: Offer, now: float) -> None:
        """``node`` offers ``offer`` (a holder that offers again replaces its vote; one
        distrusted gets none back)."""
        if node in self.distrusted:
            return
        self.offers[node] = offer
        self.refused.discard(node)
        if self.first is None:
            self.first = now

    def refusal(self, node: str) -> None:
        """``node`` does not offer the slice (it holds another file, or none)."""
        self.offers.pop(node, None)
        self.refused.add(node)

    def backers(self, offer: Offer) -> list[str]:
        """The holders that offer ``offer``."""
        return sorted(n for n, o in self.offers.items() if o == offer)

    def distrust(self, offer: Offer, why: str) -> list[str]:
        """Take the vote away from every holder of ``offer`` (its bytes were found
        bad); those holders."""
        nodes = self.backers(offer)
        for n in nodes:
            self.distrusted[n] = why
            del self.offers[n]
        return nodes

    def front(self) -> Offer | None:
        """The offer most holders have made so far (the earliest on a tie): what a
        fetch may pull while the count is open, to be kept only once it is named."""
        counts: dict[Offer, int] = {}
        for o in self.offers.values():  # in the order they first came
            counts[o] = counts.get(o, 0) + 1
        return max(counts, key=lambda o: counts[o]) if counts else None

    def decide(self, listed: Iterable[str], now: float) -> Verdict:
        """Count the votes among the holders ``listed`` now (see the module's rules)."""
        voters = (set(listed) | set(self.offers)) - set(self.distrusted) - self.refused
        groups: dict[Offer, list[str]] = {}
        for n in sorted(voters):
            o = self.offers.get(n)
            if o is not None:
                groups.setdefault(o, []).append(n)
        if not groups:
            return Verdict()
        ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))
        best, nodes = ranked[0]
        if len(nodes) > len(voters) // 2:
            return Verdict(best, tuple(nodes))
        everyone = voters <= set(self.offers)
        waited = self.first is not None and now - self.first >= self.wait
        if not (everyone or waited):
            return Verdict()
        if len(ranked) == 1 or len(nodes) > len(ranked[1][1]):
            return Verdict(best, tuple(nodes))
        if everyone:
            return Verdict(tie=describe(groups))
        return Verdict()  # a tie with holders still to answer: they may break it


def describe(groups: dict[Offer, list[str]]) -> str:
    """Who offers which root, in words."""
    return "; ".join(
        f"{', '.join(nodes)} offer{'s' if len(nodes) == 1 else ''} root {offer[0][:12]}"
        for offer, nodes in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    )

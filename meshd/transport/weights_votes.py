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
- never on a tie: the fetch cannot tell honest from lying, and says so.

The count is taken again at every offer and while the fetch runs: a late offer that
makes another root lead switches the fetch to it (it starts over); one that makes a tie
fails it.

Limits, stated plainly: a lone holder's root is whatever it says (the fetcher checks
what it can against the model's own facts before loading, see ``fetch_slice``'s
``verify``); liars that outnumber the honest holders win; a fetch that completes before
a slow honest holder answers keeps the root of those that answered in time.
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
        """``node`` offers ``offer`` (a holder that offers again replaces its vote)."""
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
        return Verdict(tie=describe(groups))


def describe(groups: dict[Offer, list[str]]) -> str:
    """Who offers which root, in words."""
    return "; ".join(
        f"{', '.join(nodes)} offer{'s' if len(nodes) == 1 else ''} root {offer[0][:12]}"
        for offer, nodes in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    )

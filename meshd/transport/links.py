"""How fast the link to each peer moves bytes, from the mesh requests that carry many.

A mesh request's time is a round trip plus the time its bytes take on the wire; a
request that carries :data:`MIN_SAMPLE_BYTES` or more (a welcome or a pull page of a
big state, or the probe gossip sends now and then, see ``gossip.PROBE_BYTES``) says
how fast the link is: its bytes over its time less the link's round trip. Smaller
ones say nothing (a round trip's jitter is larger than their wire time) and only feed
the round trip.

The figure decays: each sample moves it by :data:`WEIGHT` of the way (less for a
sample near the least size), so one busy moment does not rule placement, and the link
after a change (Wi-Fi to cable) is known after a few samples. A link faster than a
sample can tell (loopback: the probe's bytes take less time than the round trip's
jitter) is counted at the rate of the sample's bytes over half its time: a lower bound,
far above any link placement must weigh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MIN_SAMPLE_BYTES", "WEIGHT", "LinkMeter", "sample_rate"]

#: Requests with fewer bytes (both ways together) are not bandwidth samples.
MIN_SAMPLE_BYTES = 64 * 1024
#: How far one full sample moves the estimate towards itself.
WEIGHT = 0.5
#: A sample of this many bytes or more weighs :data:`WEIGHT`; one of fewer, in proportion.
FULL_SAMPLE_BYTES = 256 * 1024


def sample_rate(nbytes: int, elapsed_s: float, rtt_s: float | None) -> float | None:
    """Bytes per second of a request that moved ``nbytes`` in ``elapsed_s`` over a link
    whose round trip is ``rtt_s`` (None: unknown), or None when it says nothing (too few
    bytes, or a time that is not one)."""
    if nbytes < MIN_SAMPLE_BYTES or not (elapsed_s > 0 and math.isfinite(elapsed_s)):
        return None
    wire = elapsed_s - (rtt_s or 0.0)
    # The round trip's jitter can exceed a fast link's wire time: never count less
    # than half the request's time for its bytes (see the module doc).
    return nbytes / max(wire, elapsed_s / 2)


@dataclass
class _Link:
    bps: float
    samples: int
    #: When the last sample came (the meter's caller's clock).
    at: float


class LinkMeter:
    """The decaying bandwidth estimate of this node's link to each peer."""

    def __init__(self) -> None:
        self._links: dict[str, _Link] = {}

    def sample(
        self, peer: str, nbytes: int, elapsed_s: float, rtt_s: float | None, now: float
    ) -> bool:
        """Fold one request of ``nbytes`` that took ``elapsed_s``, ending at ``now``, into
        ``peer``'s figure; True when it counted (see :func:`sample_rate`)."""
        rate = sample_rate(nbytes, elapsed_s, rtt_s)
        if rate is None:
            return False
        link = self._links.get(peer)
        if link is None:
            self._links[peer] = _Link(rate, 1, now)
            return True
        w = WEIGHT * min(1.0, nbytes / FULL_SAMPLE_BYTES)
        # Geometric: a link's rate spans orders of magnitude, and one outlier should move
        # the figure by a factor, not swamp it.
        link.bps = math.exp(math.log(link.bps) + w * (math.log(rate) - math.log(link.bps)))
        link.samples += 1
        link.at = now
        return True

    def samples(self, peer: str) -> int:
        """How many samples ``peer``'s figure holds (0: none yet)."""
        link = self._links.get(peer)
        return link.samples if link is not None else 0

    def last(self, peer: str) -> float | None:
        """When ``peer``'s last sample came (None: never)."""
        link = self._links.get(peer)
        return link.at if link is not None else None

    def forget(self, peer: str) -> None:
        """Drop ``peer``'s figure (it left)."""
        self._links.pop(peer, None)

    def mbps(self) -> dict[str, float]:
        """Each measured link's bandwidth in Mbit/s, by peer id (unmeasured: absent)."""
        return {k: round(v.bps * 8 / 1e6, 2) for k, v in sorted(self._links.items()) if v.bps > 0}

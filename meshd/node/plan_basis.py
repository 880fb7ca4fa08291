"""A plan's basis as the nodes in it signed it: each node's figures are derived again
from its own card and heartbeat, never taken from the plan's writer.

The writer of a plan attaches, per node of the basis, the clock of the card it read and
the heartbeat entry itself, signature included (:func:`signed_sources`). Any node then
checks (:func:`figures_refusal`) that

* the heartbeat is the node's own, signed by its member key, and from the moments
  before the plan (at most :data:`BEAT_WINDOW_MS` older than the plan's clock: a
  writer may not pick an old heartbeat from when the node had less memory free);
* the card it holds is the one named, or a newer one with the same figures (a node
  that restarted on the same machine), and
* the figures in the basis are exactly those :func:`~meshd.placement.node_resources`
  derives from that card and heartbeat (GPU memory may be less: the stages of other
  instances on the node take their share of it).

Pure: the verdict depends only on the plan and the state held.
"""

from __future__ import annotations

from meshd.crdt.hlc import LOGICAL_BITS
from meshd.crdt.lww import LWWMap
from meshd.crdt.views import (
    Health,
    Member,
    NodeCard,
    NodeSource,
    decode,
    health_key,
    member_key,
    node_key,
)
from meshd.domain.nodes import NodeResources
from meshd.placement import node_resources
from meshd.transport.identity import verify_entry

__all__ = ["BEAT_WINDOW_MS", "figures_refusal", "hlc_ms", "signed_sources"]

#: How much older than its plan a node's heartbeat in the basis may be (ms): the HLC
#: drift bound (a peer's clock may run up to 60 s ahead of the writer's, and the
#: writer's HLC then follows it) plus a node's silence before it counts as dead, with
#: room to spare.
BEAT_WINDOW_MS = 90_000


def hlc_ms(ms: int) -> int:
    """``ms`` milliseconds as a difference of HLC timestamps."""
    return ms << LOGICAL_BITS


def signed_sources(m: LWWMap, nodes: list[NodeResources]) -> list[NodeSource] | None:
    """Each node's card clock and heartbeat entry as ``m`` holds them (the writer's
    side: what its figures were derived from); None if one lacks either."""
    out = []
    for n in nodes:
        card, beat = m.get(node_key(n.id)), m.get(health_key(n.id))
        if card is None or beat is None or card.value is None or beat.value is None:
            return None
        out.append(NodeSource(card=card.hlc, health=beat))
    return out


def _held_card(m: LWWMap, nid: str) -> tuple[int, NodeCard] | None:
    e = m.get(node_key(nid))
    card = None if e is None or e.writer != nid else decode(e.value or b"", NodeCard)
    return None if e is None or card is None or card.id != nid else (e.hlc, card)


def _beat(src: NodeSource, nid: str, m: LWWMap, hlc: int, secured: bool) -> Health | str:
    """The heartbeat of ``src`` if it is ``nid``'s own, signed and recent; else why not."""
    e = src.health
    if e.key != health_key(nid) or e.writer != nid or e.value is None:
        return "forged_basis"
    beat = decode(e.value, Health)
    if beat is None:
        return "forged_basis"
    if secured:
        member = decode(m.value(member_key(nid)) or b"", Member)
        if member is None:
            return "implausible_plan"  # no member: nobody vouches for its figures
        if not verify_entry(member.key, e):
            return "forged_basis"
    if not hlc - hlc_ms(BEAT_WINDOW_MS) <= e.hlc < hlc:
        return "stale_basis"
    return beat


def figures_refusal(
    n: NodeResources, src: NodeSource, m: LWWMap, hlc: int, secured: bool
) -> str | None:
    """Why node ``n`` of a plan stamped ``hlc`` is refused, or None: its figures must be
    the ones its own card and heartbeat (``src``) give (see the module doc)."""
    held = _held_card(m, n.id)
    if held is None or held[0] < src.card:
        return "unverifiable_plan"  # its card (that one) has not arrived yet: asked again
    beat = _beat(src, n.id, m, hlc, secured)
    if isinstance(beat, str):
        return beat
    live = [n.id, *beat.rtt_ms, *beat.bw_mbps]
    want = node_resources({n.id: held[1]}, {n.id: beat}, live)[n.id]
    same = (n.name, n.backends, n.mem_available, n.mem_total, n.decode_bps, n.holds) == (
        want.name, want.backends, want.mem_available, want.mem_total, want.decode_bps,
        want.holds,
    )  # fmt: skip
    # Round trips and bandwidths: to the nodes the writer placed among, as measured.
    same = same and all(want.rtt_ms.get(k) == v for k, v in n.rtt_ms.items())
    same = same and all(want.bw_mbps.get(k) == v for k, v in n.bw_mbps.items())
    # GPUs: the card's, with no more free memory than probed (other instances' stages
    # on the node take theirs, which the writer subtracted).
    same = same and len(n.devices) == len(want.devices)
    for d, w in zip(n.devices, want.devices, strict=False):
        same = same and (d.backend, d.name, d.description, d.mem_total, d.unified) == (
            w.backend, w.name, w.description, w.mem_total, w.unified
        ) and 0 <= d.mem_free <= w.mem_free  # fmt: skip
    if same:
        return None
    # Figures another card gave, when a newer card is held: out of date, not forged.
    return "forged_basis" if held[0] == src.card else "stale_basis"

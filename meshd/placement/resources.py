"""What placement knows about a node: a small, flat view of its card and heartbeat."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from meshd.crdt.views import Health, NodeCard, NodeResources

__all__ = ["MEM_QUANTUM", "NodeResources", "less_gpu", "node_resources", "quantize_mem"]


#: ``mem_available`` is rounded down to a multiple of this many bytes (or of 1/16 of
#: the node's ``mem_total``, the larger), so that placement's input does not follow
#: every heartbeat's wobble: survivors that repair a plan at once read heartbeats a
#: few hundred ms apart and, with exact figures, could split the layers differently
#: (each writing its own generation + 1, one winning by LWW after both began to
#: load). Rounded, two snapshots that differ by less than the step (and do not
#: straddle a step boundary) are the same input, hence the same plan. Rounding down
#: only ever under-states memory, which placement already treats as a budget.
MEM_QUANTUM = 256 * 1024 * 1024
MEM_TOTAL_SHARE = 16


def quantize_mem(mem_available: int, mem_total: int = 0) -> int:
    """``mem_available`` rounded down to placement's step (see :data:`MEM_QUANTUM`)."""
    q = max(MEM_QUANTUM, mem_total // MEM_TOTAL_SHARE // MEM_QUANTUM * MEM_QUANTUM)
    return max(0, mem_available) // q * q


def node_resources(
    cards: Mapping[str, NodeCard],
    healths: Mapping[str, Health],
    live: Iterable[str],
) -> dict[str, NodeResources]:
    """The resources of every live node that has a card, by node id (sorted by id).

    ``mem_available`` and ``tokens_per_s`` come from the node's heartbeat when it has
    one that reports them (a heartbeat's 0 means "not reported"), else from its card
    (``tokens_per_s`` is then 0, unmeasured). A live id without a card is skipped:
    placement cannot know what it runs. ``mem_available`` is rounded down with
    :func:`quantize_mem`, so that survivors compute a repair from the same figures.
    ``devices`` are the card's GPUs as probed (see :func:`less_gpu`).
    """
    out: dict[str, NodeResources] = {}
    for nid in sorted(set(live)):
        card = cards.get(nid)
        if card is None:
            continue
        health = healths.get(nid)
        mem = card.mem_available
        tps = 0.0
        holds: set[str] = set()
        if health is not None:
            if health.mem_available > 0:
                mem = health.mem_available
            tps = health.tokens_per_s
            holds = {r.instance for r in health.runners if r.state in ("loading", "ready")}
        out[nid] = NodeResources(
            id=nid,
            name=card.name,
            backends=sorted(set(card.backends)),
            mem_available=quantize_mem(mem, card.mem_total),
            mem_total=card.mem_total,
            tokens_per_s=tps,
            holds=sorted(holds),
            devices=list(card.devices),
        )
    return out


def less_gpu(r: NodeResources, taken: int) -> NodeResources:
    """``r`` with ``taken`` bytes of its dedicated GPUs' free memory in use, taken
    from its devices in order (the stages of other instances on the node)."""
    if taken <= 0 or not r.devices:
        return r
    devices = []
    for d in r.devices:
        cut = 0 if d.unified else min(taken, d.mem_free)
        taken -= cut
        devices.append(msgspec.structs.replace(d, mem_free=d.mem_free - cut))
    return msgspec.structs.replace(r, devices=devices)

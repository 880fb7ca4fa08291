"""What placement knows about a node: a small, flat view of its card and heartbeat."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import msgspec

from meshd.crdt.views import Health, NodeCard
from meshd.domain.nodes import NodeResources

__all__ = [
    "MEM_QUANTUM",
    "NodeResources",
    "less_gpu",
    "node_resources",
    "quantize_bw",
    "quantize_mem",
]


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


#: Steps of the speed figures placement reads, as a factor: a node's measured speed
#: wobbles by a few percent from one heartbeat to the next, and survivors that repair
#: a plan at once must read the same figure (as with ``MEM_QUANTUM``).
SPEED_STEP = 2 ** (1 / 4)
#: Round trips shorter than this (ms) are the same to placement (a loopback, a switch).
RTT_FLOOR_MS = 0.25
#: Bandwidths below this (Mbit/s) are this to placement.
BW_FLOOR_MBPS = 1.0


def quantize_speed(value: float) -> float:
    """``value`` (> 0) rounded down to a power of :data:`SPEED_STEP`; 0 stays 0."""
    if not (value > 0 and math.isfinite(value)):
        return 0.0
    return float(f"{SPEED_STEP ** math.floor(math.log(value, SPEED_STEP) + 1e-9):.4g}")


def quantize_rtt(ms: float) -> float:
    """A round trip rounded up to a power of two ms, at least :data:`RTT_FLOOR_MS`."""
    if not (ms > 0 and math.isfinite(ms)):
        return RTT_FLOOR_MS
    return max(RTT_FLOOR_MS, 2.0 ** math.ceil(math.log2(ms)))


def quantize_bw(mbps: float) -> float:
    """A bandwidth (Mbit/s) rounded down to a power of two, at least
    :data:`BW_FLOOR_MBPS`; 0.0 (unknown) for a figure that is not one."""
    if not (mbps > 0 and math.isfinite(mbps)):
        return 0.0
    return max(BW_FLOOR_MBPS, 2.0 ** math.floor(math.log2(mbps)))


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

    ``mem_available``, ``decode_bps``, ``rtt_ms`` and ``bw_mbps`` come from the node's
    heartbeat when it has one that reports them (a heartbeat's 0 means "not reported"),
    else ``mem_available`` from its card (``decode_bps`` is then 0, unmeasured); the
    speed, round trips and bandwidths are rounded (:func:`quantize_speed`,
    :func:`quantize_rtt`, :func:`quantize_bw`), links kept only to the nodes given. A
    live id without a card is skipped: placement cannot know what it runs.
    ``mem_available`` is rounded down with :func:`quantize_mem`, so that survivors
    compute a repair from the same figures.
    ``devices`` are the card's GPUs as probed (see :func:`less_gpu`).
    """
    out: dict[str, NodeResources] = {}
    live_ids = set(live)
    for nid in sorted(live_ids):
        card = cards.get(nid)
        if card is None:
            continue
        health = healths.get(nid)
        mem = card.mem_available
        bps = 0.0
        rtt: dict[str, float] = {}
        bw: dict[str, float] = {}
        holds: set[str] = set()
        if health is not None:
            if health.mem_available > 0:
                mem = health.mem_available
            bps = quantize_speed(health.decode_bps)
            rtt = {k: quantize_rtt(v) for k, v in sorted(health.rtt_ms.items()) if k in live_ids}
            bw = {
                k: q
                for k, v in sorted(health.bw_mbps.items())
                if k in live_ids and (q := quantize_bw(v)) > 0
            }
            holds = {r.instance for r in health.runners if r.state in ("loading", "ready")}
        out[nid] = NodeResources(
            id=nid,
            name=card.name,
            backends=sorted(set(card.backends)),
            mem_available=quantize_mem(mem, card.mem_total),
            mem_total=card.mem_total,
            decode_bps=bps,
            holds=sorted(holds),
            rtt_ms=rtt,
            devices=list(card.devices),
            bw_mbps=bw,
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

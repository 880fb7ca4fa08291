"""A plan is taken only if this node's own ``place()`` gives it again.

Placement is deterministic: the same spec, facts, nodes and previous stages give the
same stages on every node. A plan carries what it was computed from
(:class:`~meshd.crdt.views.PlanBasis`), so any node can run ``place()`` on it and
compare; a plan that does not come out the same was not made by placement (``bad_plan``,
``unreproducible_plan``). The nodes it was computed over must be plausible: members of
the cluster whose cards exist, offering no more memory than their machines have and
no backend they do not have (``implausible_plan``). Pure: the verdict depends only on
the entry and the state held.
"""

from __future__ import annotations

from meshd.crdt.lww import Entry, LWWMap
from meshd.crdt.views import (
    Instance,
    NodeCard,
    decode,
    member_key,
    node_key,
)
from meshd.placement import PlacementError, default_context, place

__all__ = ["plan_refusal", "refuse_plan_entry"]


def refuse_plan_entry(e: Entry, m: LWWMap) -> str | None:
    """Why the instance entry ``e`` is refused given the state ``m``, or None."""
    inst = decode(e.value or b"", Instance)
    if inst is None or e.key != f"instance/{inst.id}":
        return "bad_plan"
    return plan_refusal(inst, m)


def plan_refusal(inst: Instance, m: LWWMap) -> str | None:
    """Why ``inst``'s plan is refused given the state ``m``, or None to take it."""
    basis, facts = inst.basis, inst.facts
    if basis is None or facts is None:
        return "unverifiable_plan"
    if basis.spec.model != inst.spec.model or basis.spec not in (
        inst.spec, inst.spec.relaxed()
    ):  # fmt: skip
        return "bad_plan"
    nodes = {n.id: n for n in basis.nodes}
    if len(nodes) != len(basis.nodes) or any(s.node not in nodes for s in inst.stages):
        return "bad_plan"
    secured = any(True for _ in m.live("member/"))
    for n in basis.nodes:
        card = decode(m.value(node_key(n.id)) or b"", NodeCard)
        if card is None:
            return "unverifiable_plan"  # its card has not arrived yet: asked again later
        if secured and m.value(member_key(n.id)) is None:
            return "implausible_plan"
        if n.mem_available > max(card.mem_total, card.mem_available):
            return "implausible_plan"
        if not set(n.backends) <= set(card.backends):
            return "implausible_plan"
        # GPUs only as the card says, with no more free memory than it had.
        probed = {(d.backend, d.name): d for d in card.devices}
        for d in n.devices:
            c = probed.get((d.backend, d.name))
            if c is None or d.unified != c.unified or d.mem_free > max(c.mem_free, c.mem_total):
                return "implausible_plan"
    previous = None
    if basis.previous is not None:
        previous = Instance(
            id=inst.id, spec=inst.spec, stages=list(basis.previous),
            generation=max(1, inst.generation - 1), facts=facts,
        )  # fmt: skip
    try:
        stages = place(basis.spec, facts, nodes, previous=previous)
    except PlacementError:
        return "unreproducible_plan"
    if stages != inst.stages:
        return "unreproducible_plan"
    # A record from before the context was kept (0) says nothing to check.
    if inst.context and inst.context != default_context(
        basis.spec, facts, nodes, stages, previous
    ):  # fmt: skip
        return "unreproducible_plan"
    return None

"""A plan is taken only if this node's own view of the cluster gives it again.

Placement is deterministic: the same spec, facts, nodes and previous stages give the
same stages on every node. A plan carries what it was computed from
(:class:`~meshd.crdt.views.PlanBasis`), and every node checks it before taking it:

1. **Signed figures.** Each node of the basis is a member whose figures are exactly
   the ones its own card and heartbeat give, both signed by it
   (:mod:`meshd.node.plan_basis`: ``forged_basis``, ``stale_basis``; a node that is
   no member: ``implausible_plan``).
2. **Reproducible.** ``place()`` over the basis gives the plan's stages and context
   (``bad_plan``, ``unreproducible_plan``).
3. **Complete.** The basis leaves out no node this node knows was up when the plan was
   made and could serve the model: ``place()`` over the basis plus those nodes (with
   the figures this node holds for them) must give the same stages, else
   ``partial_basis``. A node counts when its card is older than the plan by
   :data:`JOIN_MARGIN_MS` (it was there, and seen) and its last heartbeat, ``up``, is
   at most :data:`LIVE_MS` older than the plan or newer (it was not dead to the
   writer: a node is after 2 s of silence). Nodes the writer's own rules leave out are
   not counted: nodes that gave up on the instance, the owner's exclusions, nodes of
   other replicas of the model (for a fresh plan that avoided them), nodes that do not
   hold the model while holders sufficed.

A plan stamped ahead of every heartbeat held (by more than :data:`AHEAD_MS`) cannot be
judged yet: ``unverifiable_plan``, judged again when anti-entropy offers it next (a
plan dated in the future would otherwise find no node recent). Pure: the verdict
depends only on the entry (its clock and writer included) and the state held. A plan
refused in a race (a node back from a partition) is placed again by the nodes that
took it, once they see that node too (``Instances``, with :func:`left_out`).
"""

from __future__ import annotations

from collections.abc import Set

from meshd.crdt.lww import Entry, LWWMap
from meshd.crdt.views import (
    HEALTH,
    NODE,
    Health,
    Instance,
    cards,
    decode,
    health_key,
    healths,
    instances,
    member_key,
    members,
)
from meshd.domain.nodes import NodeResources
from meshd.placement import PlacementError, default_context, place, place_fetching

from .cluster import ClusterView
from .plan_basis import figures_refusal, hlc_ms

__all__ = ["AHEAD_MS", "JOIN_MARGIN_MS", "LIVE_MS", "left_out", "plan_refusal", "refuse_plan_entry"]

#: A node whose card is younger than the plan by less than this (ms) may have joined
#: after the writer looked: leaving it out is no fault (a joiner's card and first
#: heartbeat reach every member within a gossip round, well under a second).
JOIN_MARGIN_MS = 3_000
#: A node whose last heartbeat is older than the plan by more than this (ms) may have
#: been dead to its writer (``DEAD_AFTER``, 2 s, less a margin for clocks).
LIVE_MS = 1_500
#: How far ahead of the newest heartbeat held (another node's) a plan may be stamped
#: and still be judged now (ms): below ``LIVE_MS`` less a heartbeat interval, so a node
#: beating all along is recent enough to count for any plan judged.
AHEAD_MS = 1_000


def refuse_plan_entry(e: Entry, m: LWWMap) -> str | None:
    """Why the instance entry ``e`` is refused given the state ``m``, or None."""
    if m.get(e.key) == e:
        return None  # taken before (anti-entropy offers it again): nothing new to judge
    inst = decode(e.value or b"", Instance)
    if inst is None or e.key != f"instance/{inst.id}":
        return "bad_plan"
    return plan_refusal(inst, m, e.hlc, e.writer)


def plan_refusal(inst: Instance, m: LWWMap, hlc: int, writer: str = "") -> str | None:
    """Why ``inst``'s plan, stamped ``hlc`` by ``writer``, is refused given the state
    ``m``, or None to take it (see the module doc)."""
    basis, facts = inst.basis, inst.facts
    if basis is None or facts is None:
        return "unverifiable_plan"
    beats = [e.hlc for e in m.live(HEALTH) if e.writer != writer]
    if beats and hlc > max(beats) + hlc_ms(AHEAD_MS):
        return "unverifiable_plan"  # from the future: judged when the cluster gets there
    if basis.spec.model != inst.spec.model or basis.spec not in (
        inst.spec, inst.spec.relaxed()
    ):  # fmt: skip
        return "bad_plan"
    nodes = {n.id: n for n in basis.nodes}
    if len(nodes) != len(basis.nodes) or any(s.node not in nodes for s in inst.stages):
        return "bad_plan"
    if len(basis.sources) != len(basis.nodes):
        return "unverifiable_plan"  # a plan without its sources: nothing signed to check
    secured = any(True for _ in m.live("member/"))
    for n, src in zip(basis.nodes, basis.sources, strict=True):
        why = figures_refusal(n, src, m, hlc, secured)
        if why is not None:
            return why
    previous = _previous(inst)
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
    return "partial_basis" if left_out(inst, m, hlc) else None


def _previous(inst: Instance) -> Instance | None:
    basis = inst.basis
    if basis is None or basis.previous is None:
        return None
    return Instance(
        id=inst.id, spec=inst.spec, stages=list(basis.previous),
        generation=max(1, inst.generation - 1), facts=inst.facts,
    )  # fmt: skip


def _up_at(m: LWWMap, hlc: int, skip: Set[str], secured: bool) -> set[str]:
    """Nodes (not in ``skip``) whose card is older than ``hlc`` by the join margin and
    whose last heartbeat, ``up``, is recent at ``hlc`` or newer: up when it was made."""
    out = set()
    for e in m.live(NODE):
        nid = e.key[len(NODE) :]
        if nid in skip or e.writer != nid or e.hlc > hlc - hlc_ms(JOIN_MARGIN_MS):
            continue
        if secured and m.value(member_key(nid)) is None:
            continue
        beat = m.get(health_key(nid))
        if beat is None or beat.writer != nid or beat.hlc < hlc - hlc_ms(LIVE_MS):
            continue
        h = decode(beat.value or b"", Health)
        if h is not None and h.state == "up":
            out.add(nid)
    return out


def left_out(inst: Instance, m: LWWMap, hlc: int) -> set[str]:
    """The nodes that ``inst``'s basis (a plan stamped ``hlc``) leaves out and that
    would change its stages: up when it was made, able to serve the model by the rules
    placement's inputs follow (see the module doc). Empty when none would."""
    basis, facts = inst.basis, inst.facts
    if basis is None or facts is None:
        return set()
    ids = {n.id for n in basis.nodes}
    secured = any(True for _ in m.live("member/"))
    extra = _up_at(m, hlc, ids, secured)
    if not extra:
        return set()
    fresh = basis.previous is None and not basis.spec.nodes
    # The other instances only matter to a fresh plan (decoding them all costs).
    others = {k: v for k, v in instances(m).items() if k != inst.id} if fresh else {}
    view = ClusterView(
        self_id="", cards=cards(m), healths=healths(m), instances=others,
        liveness=dict.fromkeys(ids | extra, "alive"), ages={}, members=members(m),
    )  # fmt: skip
    extra -= set(view.gave_up_on(inst))
    if fresh:
        # A fresh replica avoids the nodes of the others when it can (``place_new``).
        busy = {s.node for i in view.replicas(basis.spec.model) for s in i.stages}
        if not busy & ids:
            extra -= busy
    held = view.holders(basis.spec.model, facts)
    fetch = view.fetchers(basis.spec.model, facts, held)
    new_h = {k: v for k, v in held.items() if k in extra}
    new_f = {k: v for k, v in fetch.items() if k in extra}
    if not new_h and not new_f:
        return set()
    own: dict[str, NodeResources] = {n.id: n for n in basis.nodes}
    holders = {k: v for k, v in own.items() if k in held or k not in fetch} | new_h
    fetchers = {k: v for k, v in own.items() if k not in holders} | new_f
    try:
        stages, _ = place_fetching(basis.spec, facts, holders, fetchers, _previous(inst))
    except PlacementError:
        return set()  # more nodes and no plan: nothing says the writer erred
    return set() if stages == inst.stages else set(new_h) | set(new_f)

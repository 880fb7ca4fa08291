"""The cluster as one node sees it at one moment, and the questions asked of it.

:class:`ClusterView` is a frozen snapshot: the node cards, heartbeats and instances of
the shared map, decoded once, plus each node's liveness on this node's clock at the
moment the view was taken. Every query on it is a pure function of the snapshot (no
clock, no I/O), so the request path, the repair loop, the API and the tests ask the
same questions and get the same answers; build one from literals in a REPL to try a
rule.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from meshd.crdt.liveness import Liveness, State
from meshd.crdt.lww import LWWMap
from meshd.crdt.views import (
    Health,
    Instance,
    InstanceSpec,
    Member,
    NodeCard,
    PlanBasis,
    RunnerStatus,
    cards,
    healths,
    instances,
    members,
)
from meshd.domain.facts import ModelFacts
from meshd.domain.nodes import NodeResources
from meshd.engines.protocol import STAGE_FAULT
from meshd.models import canonical_name
from meshd.placement import (
    Placement,
    PlacementError,
    instance_context,
    node_resources,
    node_vram,
    placement,
    predicted_tokens_s,
    repair_needed,
    stage_offload,
)
from meshd.placement.drafts import NO_DRAFT, pick_draft
from meshd.placement.resources import less_gpu
from meshd.transport import wire
from meshd.transport.identity import curve_public_of

from .instance_status import (
    INSTANCE_STATES,
    InstanceSpeed,
    StageState,
    fetch_progress,
    instance_state,
    speed_of,
)

__all__ = [
    "CRASH_LOOP",
    "FETCH_FAILED",
    "INSTANCE_STATES",
    "MODEL_MISSING",
    "REFUSED",
    "ClusterView",
    "InstanceSpeed",
    "StageState",
    "fetch_progress",
    "gave_up",
    "instance_state",
]

#: Reason prefixes of a runner its node gave up on (it will not come back by itself).
CRASH_LOOP = "crash loop"
MODEL_MISSING = "model not available here"
#: The node could not fetch its stage's slice from the nodes that hold the model.
FETCH_FAILED = "fetch failed"
#: The node will not take the stage (more stages or memory than it admits).
REFUSED = "refused by this node"


def gave_up(status: RunnerStatus) -> bool:
    """True when a runner will not come back on its own: placement should move it."""
    why = (CRASH_LOOP, MODEL_MISSING, FETCH_FAILED, REFUSED, STAGE_FAULT)  # faulty output
    return status.state == "failed" and status.reason.startswith(why)


@dataclass(frozen=True)
class ClusterView:
    """The shared state at one moment, with each node's liveness as seen from here."""

    self_id: str
    cards: Mapping[str, NodeCard]
    healths: Mapping[str, Health]
    instances: Mapping[str, Instance]
    #: Liveness of every node a heartbeat was seen from (this node: ``alive``).
    liveness: Mapping[str, State]
    #: Seconds since each node's last heartbeat arrived (this node: 0).
    ages: Mapping[str, float]
    #: The members of a secured cluster (empty in an open one).
    members: Mapping[str, Member] = field(default_factory=dict)

    @classmethod
    def build(cls, m: LWWMap, self_id: str, liveness: Liveness, now: float) -> ClusterView:
        """A view of ``m`` with ``liveness`` read at ``now`` (monotonic seconds)."""
        states: dict[str, State] = {}
        ages: dict[str, float] = {}
        for nid in liveness.nodes():
            st = liveness.state(nid, now)
            age = liveness.age(nid, now)
            if st is not None:
                states[nid] = st
            if age is not None:
                ages[nid] = age
        states[self_id] = "alive"
        ages[self_id] = 0.0
        return cls(self_id, cards(m), healths(m), instances(m), states, ages, members(m))

    # -- nodes ---------------------------------------------------------------------
    def is_live(self, nid: str) -> bool:
        """Alive or suspect: still counted by placement (suspect does not move work)."""
        return self.liveness.get(nid) in ("alive", "suspect")

    def is_alive(self, nid: str) -> bool:
        """Alive and not even suspect (stricter than :meth:`is_live`)."""
        return self.liveness.get(nid) == "alive"

    def serving(self, nid: str) -> bool:
        """Live and not draining: a node placement may give stages to."""
        h = self.healths.get(nid)
        return self.is_live(nid) and (h is None or h.state == "up")

    def senders(self, inst: Instance) -> frozenset[bytes] | None:
        """The CURVE keys (Z85) of ``inst``'s stages: the only senders a request's
        chunks are taken from (None in an open cluster: no keys to tell them by)."""
        if not self.members:
            return None
        keys = [self.members[s.node].key for s in inst.stages if s.node in self.members]
        return frozenset(curve_public_of(k) for k in keys)

    def label(self, nid: str) -> str:
        """``name (id)`` for logs, or the bare id of a node without a card."""
        c = self.cards.get(nid)
        return f"{c.name} ({nid})" if c else nid

    # -- models --------------------------------------------------------------------
    def known_models(self) -> list[str]:
        """Models the cluster can serve: placed ones and those some live node holds."""
        names = {canonical_name(i.spec.model) for i in self.instances.values()}
        for nid, c in self.cards.items():
            if self.is_live(nid):
                names.update(canonical_name(x) for x in c.models)
        return sorted(names)

    def is_known(self, model: str) -> bool:
        """A model some live node holds, or that an instance serves."""
        return canonical_name(model) in self.known_models()

    def facts_from_peers(self, model: str) -> ModelFacts | None:
        """Facts of ``model`` as a live node that holds it advertises them."""
        canon = canonical_name(model)
        for nid, c in sorted(self.cards.items()):
            if not self.is_live(nid):
                continue
            for f in c.model_facts:
                if canonical_name(f.name) == canon:
                    return msgspec.structs.replace(f, name=model)
        return None

    # -- instances -----------------------------------------------------------------
    def replicas(self, model: str) -> list[Instance]:
        """Every instance of ``model``, by id."""
        canon = canonical_name(model)
        found = [i for i in self.instances.values() if canonical_name(i.spec.model) == canon]
        return sorted(found, key=lambda i: i.id)

    def least_loaded(self, model: str, load: Mapping[str, int]) -> Instance | None:
        """The ready instance of ``model`` with the fewest requests: ``load`` (this
        node's own, by instance id, exact) or those its first stage holds and queues
        (every node's, as of its last heartbeat), the larger; ties on id."""

        def depth(i: Instance) -> int:
            h = self.healths.get(i.stages[0].node) if i.stages else None
            held = [r.active + r.waiting for r in (h.runners if h else [])
                    if r.instance == i.id and r.stage == 0]  # fmt: skip
            return max([load.get(i.id, 0), *held])

        ready = [i for i in self.replicas(model) if self.is_ready(i)]
        return min(ready, key=lambda i: (depth(i), i.id)) if ready else None

    def draft_for(self, inst: Instance) -> tuple[Instance, wire.Addr] | None:
        """The ready instance that drafts for ``inst`` and its runner's address (see
        ``meshd.placement.drafts``), or None."""
        if not inst.stages or inst.spec.draft == NO_DRAFT:
            return None
        h = self.healths.get(inst.stages[0].node)
        ready = {}
        for c in self.instances.values():
            if c.id == inst.id or len(c.stages) != 1:
                continue
            states = self.stage_states(c)
            if states[0].state == "ready" and states[0].addr is not None:
                ready[c.id] = (c, states[0].addr)
        picked = pick_draft(
            inst, [c for c, _ in ready.values()], h.rtt_ms if h else {},
            lambda name, wanted: canonical_name(name) == canonical_name(wanted),
        )  # fmt: skip
        return ready[picked.id] if picked else None

    def find_instance(self, model: str) -> Instance | None:
        """The instance serving ``model`` (ready ones first, then by id)."""
        canon = canonical_name(model)
        found = [i for i in self.instances.values() if canonical_name(i.spec.model) == canon]
        if not found:
            return None
        found.sort(key=lambda i: (not self.is_ready(i), i.id))
        return found[0]

    def stage_states(self, inst: Instance) -> list[StageState]:
        """Each stage's runner state and address, from the nodes' heartbeats."""
        out = []
        for i, st in enumerate(inst.stages):
            card, h = self.cards.get(st.node), self.healths.get(st.node)
            state, reason, addr, fetch = "pending", "", None, (0, 0, 0.0)
            if card is None or not self.is_live(st.node):
                state, reason = "unavailable", f"node {st.node} is not live"
            elif h is not None:
                # Newest generation first: a given-up runner of an older plan may still
                # be reported beside the current one (it records why the node was left
                # out), and must not hide it.
                mine = [r for r in h.runners if r.instance == inst.id and r.stage == i]
                for r in sorted(mine, key=lambda r: -r.generation)[:1]:
                    state, reason = r.state, r.reason
                    fetch = (r.fetched, r.fetch_total, r.fetch_rate)
                    if r.generation != inst.generation and r.state == "ready":
                        state = "loading"
                    if r.port:
                        addr = wire.Addr(node=st.node, addresses=card.addresses, port=r.port)
            out.append(StageState(st.node, state, reason, addr, *fetch))
        return out

    def is_ready(self, inst: Instance) -> bool:
        """Every stage's runner is ready at the instance's generation."""
        return all(s.state == "ready" and s.addr is not None for s in self.stage_states(inst))

    def gave_up_on(self, inst: Instance) -> dict[str, RunnerStatus]:
        """Nodes whose runner for ``inst`` was given up (see :func:`gave_up`: crash loop,
        model missing, fetch failed, refused), with that runner's status: its ``reason``
        says why and when.

        The node keeps reporting a given-up runner in its heartbeat after the instance
        moved away (see ``Supervisor``), so the exclusion and its reason outlive the
        repair: placement never puts the stage back there, and the API and ``meshctl
        top`` can say why the node is not in the plan.
        """
        out: dict[str, RunnerStatus] = {}
        for nid, h in sorted(self.healths.items()):
            for r in h.runners:
                if r.instance == inst.id and gave_up(r) and nid not in out:
                    out[nid] = r
        return out

    # -- placement inputs ----------------------------------------------------------
    def live_resources(self, model: str) -> dict[str, NodeResources]:
        """Resources of the serving nodes that hold ``model`` (placement's input).

        A model named by path or repo id may go on any serving node: its runner says
        whether the file is there (and is the placed one)."""
        canon = canonical_name(model)
        anywhere = "/" in model or model.endswith(".gguf")
        holders = [
            nid for nid, c in self.cards.items()
            if self.serving(nid)
            and (anywhere or canon in {canonical_name(x) for x in c.models})
        ]  # fmt: skip
        return node_resources(self.cards, self.healths, holders)

    def weight_holders(self, model: str, sha256: str, others: bool = True) -> list[wire.Addr]:
        """The weights ROUTERs of the live nodes that advertise ``model`` with this
        sha256 (``others``: this one aside): where a node lacking it fetches slices."""
        canon = canonical_name(model)
        out = []
        for nid, c in sorted(self.cards.items()):
            if (others and nid == self.self_id) or not self.is_live(nid) or c.weights_port <= 0:
                continue
            if any(canonical_name(f.name) == canon and f.sha256 == sha256 for f in c.model_facts):
                out.append(wire.Addr(node=nid, addresses=c.addresses, port=c.weights_port))
        return out

    def holders(self, model: str, facts: ModelFacts) -> dict[str, NodeResources]:
        """:meth:`live_resources` less the nodes whose card says their file under that
        name is another one (another sha256): they run a stage only on a fetched slice."""
        canon = canonical_name(model)

        def other_file(nid: str) -> bool:
            c = self.cards[nid]
            return any(
                canonical_name(f.name) == canon and f.sha256 != facts.sha256 for f in c.model_facts
            )

        return {k: v for k, v in self.live_resources(model).items() if not other_file(k)}

    def fetchers(
        self, model: str, facts: ModelFacts, held: Mapping[str, NodeResources] | None = None
    ) -> dict[str, NodeResources]:
        """Serving nodes that lack ``model`` (or hold another file under its name) but
        could run a stage of it on a slice fetched from a holder (one live node with its
        sha256 and a weights port): a llama.cpp stage of a GGUF, an MLX stage of an MLX
        folder."""
        # Whichever node computes it: placement's inputs are the same on every node.
        if not self.weight_holders(model, facts.sha256, others=False):
            return {}
        engine = "mlx-" if facts.format == "mlx" else "llama_cpp-"
        held = self.holders(model, facts) if held is None else held
        nodes = [
            nid for nid, c in self.cards.items()
            if self.serving(nid) and nid not in held
            and any(b.startswith(engine) for b in c.backends)
        ]  # fmt: skip
        return node_resources(self.cards, self.healths, nodes)

    def _place(
        self,
        spec: InstanceSpec,
        facts: ModelFacts,
        previous: Instance | None = None,
        keep: Callable[[str], bool] = lambda nid: True,
    ) -> Placement:
        """Placement on the holders of the model first, then on fetchers too (see
        ``place_fetching``), with the context the plan serves; ``keep`` filters both."""
        held = self.holders(spec.model, facts)
        skip = previous.id if previous is not None else ""
        holders = self._gpu_left({k: v for k, v in held.items() if keep(k)}, skip)
        others = {k: v for k, v in self.fetchers(spec.model, facts, held).items() if keep(k)}
        return placement(spec, facts, holders, self._gpu_left(others, skip), previous=previous)

    def predicted_tokens_s(self, inst: Instance) -> float:
        """One request's decode tokens/s that placement predicts for ``inst`` from its
        nodes' measurements now (0.0 until each of them has measured its speed)."""
        if inst.facts is None:
            return 0.0
        nodes = node_resources(self.cards, self.healths, [s.node for s in inst.stages])
        return predicted_tokens_s(inst.facts, inst.stages, nodes.values())

    def measured_tokens_s(self, inst: Instance) -> float:
        """One request's decode tokens/s as the nodes that sent ``inst`` requests
        measured it over the last minute (1000 / the median time between
        tokens; 0.0 with none)."""
        itls = sorted(
            m.itl_ms
            for h in self.healths.values()
            if (m := h.serving.get(inst.id)) is not None and m.itl_ms > 0
        )
        return round(1000 / statistics.median(itls), 2) if itls else 0.0

    def instance_speed(self, inst: Instance) -> InstanceSpeed:
        """What every node whose API sent ``inst`` requests measured over the last
        minute, added up (see :class:`InstanceSpeed`)."""
        return speed_of(self.healths, inst)

    def _gpu_left(self, nodes: dict[str, NodeResources], skip: str) -> dict[str, NodeResources]:
        """``nodes`` with their GPUs' free memory less what the stages of every other
        instance than ``skip`` take there (a card's figure is from before they ran).
        Each is counted with the GPU memory as probed, whatever order they came in."""
        if not any(r.devices for r in nodes.values()):
            return nodes  # no GPU among them: nothing to take off
        taken: dict[str, int] = {}
        for inst in self.instances.values():
            if inst.id == skip or inst.facts is None:
                continue
            for st in inst.stages:
                r = nodes.get(st.node)
                if r is None or not r.devices:
                    continue
                vram = node_vram(r, st.engine)
                used = stage_offload(
                    inst.facts, st.start, st.end, st.engine, vram, seats=inst.spec.seats,
                    context=instance_context(inst), kv_cache=inst.spec.kv_cache,
                ).gpu_bytes  # fmt: skip
                taken[st.node] = taken.get(st.node, 0) + used
        return {k: less_gpu(r, taken.get(k, 0)) for k, r in nodes.items()}

    def place_new(
        self, spec: InstanceSpec, facts: ModelFacts, avoid: frozenset[str] = frozenset()
    ) -> Placement:
        """A fresh plan of ``spec`` off the nodes in ``avoid`` (its fellow replicas'),
        the nodes it was chosen among (``PlanBasis``) and its context. Another instance
        of the model goes on nodes the others do not use while they can hold it (more
        capacity, not shared), else shares them (pinned nodes are used as asked)."""
        busy = avoid | {s.node for i in self.replicas(spec.model) for s in i.stages}
        if busy != avoid and not spec.nodes:
            try:
                return self._place(spec, facts, keep=lambda k: k not in busy)
            except PlacementError:
                pass
        return self._place(spec, facts, keep=lambda k: k not in avoid)

    def relocatable(self, inst: Instance, without: str) -> bool:
        """Whether the serving nodes other than ``without`` can hold ``inst``."""
        if inst.facts is None:
            return False
        try:
            self._place(inst.spec.relaxed(), inst.facts, inst, keep=lambda k: k != without)
        except PlacementError:
            return False
        return True

    def _repair_keep(self, inst: Instance, strict: bool = False) -> Callable[[str], bool]:
        """Which nodes a repair of ``inst`` may use: not those that gave up on it (and,
        ``strict``, not the merely suspect ones)."""
        excluded = set(self.gave_up_on(inst))
        return lambda k: k not in excluded and (not strict or self.is_alive(k))

    def unrepairable(self, inst: Instance, strict: bool = False) -> str | None:
        """Why ``inst`` cannot serve and cannot be repaired, or None.

        A stage is lost when its node is not live (``strict``: not alive, i.e. even
        suspect) or its runner was given up. When a stage is lost and placement finds
        no plan on the nodes left, the instance will not serve again by itself: a
        request should end now with this reason rather than wait for a repair that
        :meth:`repairs` (the same inputs) will never propose.
        """
        if inst.facts is None:
            return None
        gone = self.gave_up_on(inst)
        up = self.is_alive if strict else self.is_live
        lost = [st.node for st in inst.stages if st.node in gone or not up(st.node)]
        if not lost:
            return None
        try:
            self._place(inst.spec.relaxed(), inst.facts, inst, self._repair_keep(inst, strict))
        except PlacementError as e:
            why = gone[lost[0]].reason if lost[0] in gone else "node not answering"
            return f"stage on node {lost[0]} lost ({why}); no repair possible: {e}"
        return None

    def repairs(self) -> tuple[list[Instance], dict[str, str]]:
        """The new plans of every instance with a stage on a node that is gone or gave
        up, and why each instance that needs one cannot have it (by instance id).

        Every survivor computes this on its own and, ``place`` being pure and sticky,
        gets the same plans; they carry ``generation + 1``, so concurrent identical
        writes converge through the LWW map. Nodes that gave up a runner of an instance
        are left out of its plans for good (until the node restarts or the instance is
        deleted). Pins and ``min_nodes`` shaped the first plan; a repair keeps what
        survives where it is and serves with what is left rather than not at all.
        """
        live = {n for n in self.cards if self.serving(n)}
        plans: list[Instance] = []
        failed: dict[str, str] = {}
        for inst in self.instances.values():
            if inst.facts is None:
                continue
            excluded = set(self.gave_up_on(inst))
            if not repair_needed(inst, live - excluded):
                continue
            try:
                new = self.replan(inst)
            except PlacementError as e:
                failed[inst.id] = str(e)
                continue
            if new.stages != inst.stages or new.context != inst.context:
                plans.append(new)
        return plans, failed

    def replan(self, inst: Instance) -> Instance:
        """The next generation of ``inst`` placed over the nodes seen now, sticky to its
        stages (what a repair writes, with its ``PlanBasis``); raises PlacementError."""
        if inst.facts is None:
            raise PlacementError("bad_spec", f"instance {inst.id} has no model facts")
        relaxed = inst.spec.relaxed()
        stages, nodes, context = self._place(relaxed, inst.facts, inst, self._repair_keep(inst))
        basis = PlanBasis(spec=relaxed, nodes=list(nodes.values()), previous=inst.stages)
        return Instance(
            id=inst.id, spec=inst.spec, stages=stages, generation=inst.generation + 1,
            facts=inst.facts, basis=basis, context=context, placed=inst.placed,
        )  # fmt: skip

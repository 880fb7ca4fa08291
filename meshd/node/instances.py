"""Instances as the node that serves an API sees them: which instance serves a model
(placing one when none does, and waiting for it to load), placing and removing them,
and repairing those that lost a stage.

A plan is computed with the pure ``place()`` and written as ``instance/<id>``; every
node that runs a stage of it reconciles its runners. Waits for readiness are woken by
changes of the cluster, never by polling, and keep their time limits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from meshd.crdt.views import Instance, InstanceSpec, PlanBasis, instance_key
from meshd.domain.facts import ModelFacts
from meshd.models import ModelNotFoundError, ResolvedModel, canonical_name, resolve_model
from meshd.models.facts import read_resolved_facts
from meshd.placement import PlacementError

from .cluster import ClusterView, fetch_progress
from .config import NodeConfig
from .errors import ModelLoading, RequestFailed
from .kept import KeptPlacements
from .plan_basis import signed_sources
from .plans import left_out
from .requested import check_mlx, node_ids, too_many_replicas
from .roots import ModelRoots
from .state import ClusterState

__all__ = ["Instances", "auto_instance_id"]

log = logging.getLogger("meshd.inference")

#: Repairs run at most this often, however fast the cluster changes.
_REPAIR_FLOOR_S = 0.1
#: A kept instance that did not fit is tried again at each change, and at least this often.
_RESTORE_RETRY_S = 30.0


def auto_instance_id(model: str) -> str:
    """Id of the instance placed on demand for ``model``: the same on every node, so
    nodes that place it at once write one instance, not one each (LWW keeps one plan)."""
    canon = canonical_name(model)
    return "auto-" + hashlib.blake2b(canon.encode(), digest_size=6).hexdigest()


class Instances:
    """Placing, finding, waiting for and repairing instances."""

    def __init__(
        self,
        state: ClusterState,
        config: NodeConfig,
        *,
        cache_dir: Path,
        aborted: Callable[[], str | None],
        roots: ModelRoots | None = None,
        wake: Callable[[str], None] = lambda instance_id: None,
    ) -> None:
        self.state = state
        self.config = config
        self.cache_dir = cache_dir
        self._aborted = aborted
        #: Has an unloaded instance loaded again (``Requests.wake``: this node's word).
        self._wake = wake
        #: This node's model roots: the only files it reads for a name (see roots.py).
        self.roots = roots
        #: The placements kept in the data dir (see kept.py).
        self.kept = KeptPlacements(config.data_dir, state)
        self._facts: dict[str, ModelFacts] = {}
        self._facts_locks: dict[str, asyncio.Lock] = {}
        self._unrepairable: set[tuple[str, int]] = set()
        #: Per instance: the plan's clock and the live nodes it was last checked with.
        self._complete_seen: dict[str, tuple[int, frozenset[str]]] = {}

    # -- models --------------------------------------------------------------------
    def _resolve(self, model: str) -> ResolvedModel:
        # Through the roots: a path the API was given outside them reads as "not here",
        # whether or not it exists (the error tells nothing of the disk).
        if self.roots is not None:
            return self.roots.resolve(model)
        return resolve_model(model)

    def _read_facts(self, model: str) -> ModelFacts:
        return read_resolved_facts(self._resolve(model), model, self.cache_dir)

    async def facts(self, model: str) -> ModelFacts:
        """Facts of ``model``: read from this node's file (hashing runs off the event
        loop, once), else as a live node that holds it advertises them.

        Raises ModelNotFoundError when neither has it, ModelFormatError (a ValueError)
        for a file that is no usable model.
        """
        canon = canonical_name(model)
        # One lock per model: a request for one model must not wait while another,
        # large one is hashed (a node reads the facts of every model it holds).
        lock = self._facts_locks.setdefault(canon, asyncio.Lock())
        try:
            async with lock:
                f = self._facts.get(canon)
                if f is None:
                    try:
                        f = await asyncio.to_thread(self._read_facts, canon)
                    except ModelNotFoundError:
                        # Not on this disk: a live node that holds it may have said what
                        # it is (its card), which is all placement needs (it places on
                        # holders).
                        f = self.state.view().facts_from_peers(canon)
                        if f is None:
                            raise
                        return f  # not cached: the holder may change its file
                    self._facts[canon] = f
                return f
        finally:
            # Requests may name any string: keep no lock for a name with nothing cached.
            if canon not in self._facts and not lock.locked():
                self._facts_locks.pop(canon, None)

    # -- placing -------------------------------------------------------------------
    async def place(
        self,
        spec: InstanceSpec,
        facts: ModelFacts,
        instance_id: str | None = None,
        placed: int = 0,
    ) -> Instance:
        """Compute a plan and write it; raise PlacementError when none fits. ``placed``:
        the clock of its first placement (a restored instance's; 0: now)."""
        spec = self._with_node_context(spec, facts)
        return self._write(self._plan(self.state.view(), spec, facts, instance_id, placed))

    def _plan(
        self,
        view: ClusterView,
        spec: InstanceSpec,
        facts: ModelFacts,
        instance_id: str | None = None,
        placed: int = 0,
        avoid: frozenset[str] = frozenset(),
    ) -> Instance:
        stages, nodes, context = view.place_new(spec, facts, avoid)
        return Instance(
            id=instance_id or secrets.token_hex(4),
            spec=spec,
            stages=stages,
            generation=1,
            facts=facts,
            basis=PlanBasis(spec=spec, nodes=list(nodes.values())),
            context=context,
            placed=placed or self.state.replica.clock.now(),
        )

    def _write(self, inst: Instance) -> Instance:
        self.state.write(instance_key(inst.id), self._signed(inst))
        log.info(
            "placed %s as %s: %s", inst.spec.model, inst.id,
            ", ".join(f"{s.node}[{s.start}:{s.end}) {s.engine}" for s in inst.stages),
        )  # fmt: skip
        return inst

    def _with_node_context(self, spec: InstanceSpec, facts: ModelFacts) -> InstanceSpec:
        """``spec`` with this node's ``--context`` when it says no context (within the
        model's trained one). In the spec, not the policy: every node that checks the
        plan derives the same context from it."""
        want = self.config.context
        if spec.context or not want:
            return spec
        if facts.n_ctx_train > 0:
            want = min(want, facts.n_ctx_train)
        return msgspec.structs.replace(spec, context=want)

    async def place_requested(
        self, spec: InstanceSpec, replicas: int = 1, keep: bool = False
    ) -> list[Instance]:
        """Place ``replicas`` instances of ``spec`` as a user asked (``POST
        /v1/instances``), in place of the model's automatic instance unless ``keep``.

        A placement says how the model is served: the instance a request placed on its
        own (:func:`auto_instance_id`) goes, so ``--nodes a,b`` moves the model rather
        than adding a split beside it. The plans are made as if it were gone (its GPU
        memory is free to them) and it is removed once they are written. Replicas of one
        request never share a node: when fewer fit apart than asked, PlacementError
        ``too_many_replicas`` says how many do, and nothing is placed.

        Before anything runs, refuses a model MLX would read wrongly or not at all (a
        GGUF pinned to MLX stages, or any MLX folder: only MLX can run one) with
        UnsupportedModelError.
        """
        await asyncio.to_thread(check_mlx, self._resolve, spec.model, "mlx" in spec.engines)
        facts = await self.facts(spec.model)
        view = self.state.view()
        exclude = node_ids(view, spec.exclude)
        spec = msgspec.structs.replace(spec, model=canonical_name(spec.model), exclude=exclude)
        spec = self._with_node_context(spec, facts)
        auto = auto_instance_id(spec.model)
        if not keep and auto in view.instances:
            rest = {k: v for k, v in view.instances.items() if k != auto}
            view = dataclasses.replace(view, instances=rest)
        plans: list[Instance] = []
        for _ in range(replicas):
            used = frozenset(s.node for p in plans for s in p.stages)
            try:
                plans.append(self._plan(view, spec, facts, avoid=used))
            except PlacementError as e:
                if not plans:
                    raise
                raise too_many_replicas(spec.model, replicas, plans, view, e) from None
        placed = [self._write(p) for p in plans]
        if not keep and self.remove(auto):
            log.info("removed %s, the automatic instance of %s: placed as asked", auto, spec.model)
        return placed

    def remove(self, instance_id: str) -> bool:
        """Delete an instance; False if there is none with that id."""
        if instance_id not in self.state.view().instances:
            return False
        self.state.delete(instance_key(instance_id))
        return True

    async def instance_for(
        self, model: str, wait: float | None = None, context: int = 0
    ) -> Instance:
        """The ready instance serving ``model``: the one placed, else one placed now
        (with ``context`` tokens a request; 0: the default); waits (bounded) for it to
        load.

        Raises ModelNotFoundError (no node holds it), a ValueError (not a usable model),
        PlacementError (the cluster cannot hold it), :class:`ModelLoading` (not ready in
        time) and :class:`RequestFailed` (a stage failed or was lost for good).
        """
        inst = self.state.view().find_instance(model)
        if inst is None:
            facts = await self.facts(model)
            spec = InstanceSpec(model=canonical_name(model), context=context)
            inst = await self.place(spec, facts, auto_instance_id(model))
        return await self.wait_ready(inst.id, model, wait)

    async def wait_ready(self, instance_id: str, model: str, wait: float | None = None) -> Instance:
        """Until every stage of the instance is ready (woken by cluster changes); one
        unloaded (idle past its keep-alive) is loaded again meanwhile."""
        deadline = time.monotonic() + (self.config.load_wait if wait is None else wait)
        while True:
            view = self.state.view()
            cur = view.instances.get(instance_id)
            if cur is None:
                raise RequestFailed("instance_deleted", f"instance {instance_id} was deleted", 503)
            states = view.stage_states(cur)
            if all(s.state == "ready" and s.addr for s in states):
                return cur
            if any(s.state == "unloaded" for s in states):
                self._wake(instance_id)  # idle past its keep-alive: the request waits
            # A stage that is gone (dead node, given-up runner) is repaired within a
            # moment when the cluster can hold the instance; when it cannot, nothing
            # will change by waiting: say so now, with placement's reason, instead of a
            # 503 "loading" after the whole wait.
            why = view.unrepairable(cur)
            if why is not None:
                raise RequestFailed("stage_lost", f"instance {cur.id} of {model}: {why}", 503)
            failed = [s for s in states if s.state == "failed"]
            if failed and not view.gave_up_on(cur):
                raise RequestFailed(
                    "stage_failed",
                    f"instance {cur.id} of {model}: stage on {failed[0].node} failed: "
                    f"{failed[0].reason}",
                    503,
                )
            aborted = self._aborted()
            if aborted is not None:
                raise RequestFailed("node_stopping", aborted, 503)
            left = deadline - time.monotonic()
            if left <= 0:
                detail = ", ".join(f"{s.node}: {s.state}" for s in states)
                raise ModelLoading(model, detail, *fetch_progress(states))
            await self.state.changes.wait(left)

    async def at_start(self, model: str) -> None:
        """Once the first peers have had ``settle_s`` to answer (so a node joining a
        cluster that serves its models does not place them again): place anew the
        instances kept on disk that the cluster has no entry for (a whole-house restart),
        then make sure the cluster serves ``model`` (``meshd up``'s default; "" none),
        then restore the kept ones that did not fit yet, as the cluster changes.

        The default's instance id is the same on every node, so nodes starting together
        converge on one instance.
        """
        # Read the model's facts while peers answer: the first request needs them too.
        reading = asyncio.ensure_future(self.facts(model)) if model else None
        await asyncio.sleep(self.config.settle_s)
        tried: dict[str, str] = {}
        await self._restore(tried)
        if reading is not None:
            await self._serve_default(model, reading)
        while self.kept.pending():
            await self.state.changes.wait(_RESTORE_RETRY_S)
            await self._restore(tried)

    async def _restore(self, tried: dict[str, str]) -> None:
        for k in self.kept.pending():
            try:
                facts = await self.facts(k.spec.model)
                await self.place(k.spec, facts, k.id, placed=k.placed)
                log.info("restored instance %s of %s, as kept on disk", k.id, k.spec.model)
            except Exception as e:  # said once, tried again at the next change
                if tried.get(k.id) != str(e):
                    log.warning("instance %s of %s kept on disk waits: %s", k.id, k.spec.model, e)
                tried[k.id] = str(e)

    async def _serve_default(self, model: str, reading: asyncio.Future[ModelFacts]) -> None:
        try:
            facts = await reading
        except Exception as e:
            log.warning("not serving %s: %s", model, e)
            return
        if self.state.view().find_instance(model) is not None:
            return
        try:
            await self.place(
                InstanceSpec(model=canonical_name(model)), facts, auto_instance_id(model)
            )
        except Exception as e:
            log.warning("could not place %s: %s", model, e)

    # -- repairs -------------------------------------------------------------------
    def repair(self) -> list[Instance]:
        """Write the repaired plan of every instance that lost a stage (see
        :meth:`ClusterView.repairs`); what this node wrote."""
        view = self.state.view()
        plans, failed = view.repairs()
        for iid, why in failed.items():
            cur = view.instances.get(iid)
            key = (iid, cur.generation if cur else 0)
            if key not in self._unrepairable:
                self._unrepairable.add(key)
                log.warning("instance %s cannot be repaired: %s", iid, why)
        plans += self._complete(view, {p.id for p in plans} | set(failed))
        plans = [self._signed(new) for new in plans]
        for new in plans:
            self.state.write(instance_key(new.id), new)
            excluded = sorted(view.gave_up_on(new))
            log.info(
                "repaired %s (generation %d): %s%s", new.id, new.generation,
                ", ".join(f"{s.node}[{s.start}:{s.end})" for s in new.stages),
                f" (left out: {', '.join(excluded)})" if excluded else "",
            )  # fmt: skip
        return plans

    def _signed(self, inst: Instance) -> Instance:
        """``inst`` with its basis' sources: each node's card clock and heartbeat entry
        as this node holds them now (the view its plan came from was read from this same
        state, with no wait between), so every node can check the figures."""
        if inst.basis is None:
            return inst
        sources = signed_sources(self.state.map, inst.basis.nodes) or []
        basis = msgspec.structs.replace(inst.basis, sources=sources)
        return msgspec.structs.replace(inst, basis=basis)

    def _complete(self, view: ClusterView, skip: set[str]) -> list[Instance]:
        """Plans held whose basis leaves out nodes that were up and would change them
        (refused by those nodes: see ``meshd.node.plans``), placed again over the nodes
        seen now. Checked once per plan and set of live nodes."""
        live = frozenset(n for n in view.cards if view.is_live(n))
        self._complete_seen = {k: v for k, v in self._complete_seen.items() if k in view.instances}
        out = []
        for iid, inst in view.instances.items():
            e = self.state.map.get(instance_key(iid))
            if iid in skip or e is None or self._complete_seen.get(iid) == (e.hlc, live):
                continue
            self._complete_seen[iid] = (e.hlc, live)
            missing = left_out(inst, self.state.map, e.hlc)
            if not missing:
                continue
            try:
                new = view.replan(inst)
            except PlacementError:
                continue
            seen = {n.id for n in new.basis.nodes} if new.basis else set()
            if missing <= seen:  # else this node does not see them either: no better
                log.info("placing %s again: its plan left out %s", iid, ", ".join(sorted(missing)))
                out.append(new)
        return out

    async def run_repairs(self) -> None:
        """Repair at every change of the cluster, and at least every ``repair_interval``."""
        while True:
            await self.state.changes.wait(self.config.repair_interval)
            self.repair()
            await asyncio.sleep(_REPAIR_FLOOR_S)

"""Instances and requests, as seen from the node whose API received them.

* Instances: compute a plan with the pure ``place()`` and write ``instance/<id>``;
  find the instance serving a model; tell whether all its stages are ready.
* Requests: resolve the route (every stage's runner address) from the shared state,
  send ``Generate`` to stage 0 and yield the ``DataChunk``s the last stage sends back,
  ending every request with a result or a typed :class:`RequestFailed` within bounds:
  a stage whose node or runner goes away ends it at once, a silent one after
  ``chunk_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from meshd import models
from meshd.crdt.lww import LWWMap
from meshd.crdt.views import (
    Instance,
    InstanceSpec,
    ModelFacts,
    RunnerStatus,
    cards,
    healths,
    instance_key,
    instances,
)
from meshd.placement import PlacementError, node_resources, place, repair_needed
from meshd.transport import wire
from meshd.transport.dataplane import DataPlane

log = logging.getLogger("meshd.inference")

#: Defaults, documented in docs/operations.md.
LOAD_WAIT_S = 60.0
FIRST_CHUNK_TIMEOUT_S = 30.0
CHUNK_TIMEOUT_S = 30.0
LIVENESS_POLL_S = 0.2
#: A stage whose node is merely *suspect* ends a request that has also been silent
#: this long: a healthy pipeline keeps producing, so both together mean it is gone.
SUSPECT_SILENCE_S = 1.0
#: How long a broken request waits for its repaired instance to serve before it ends
#: with ``stage_lost``. A repair that placement says is impossible ends it at once
#: (re-checked every :data:`REPLAY_POLL_S`); this bounds a repair that is possible but
#: slow (weights loading on the new node). ``meshd up --replay-wait`` sets it.
REPLAY_WAIT_S = 30.0
REPLAY_POLL_S = 0.1
#: While a streamed request waits for its repair, an SSE comment goes out this often
#: so that clients and proxies with idle timeouts keep the connection.
KEEPALIVE_S = 1.0
#: Replays one request may go through: a drain and a repair can follow each other,
#: but a plan that keeps changing under a request must not keep it forever.
MAX_REPLAYS = 4
#: Errors that mean "this plan's pipeline broke", not "this request is bad": the
#: request is replayed on the instance's next plan. ``generation_mismatch`` is what a
#: runner answers once the plan moved on (a drain, a repair, a crash-loop move).
REPLAYABLE = frozenset({"stage_lost", "generation_mismatch", "wrong_stage", "not_ready"})

#: Yielded by :meth:`Inference.generate` while a request waits for its repair: no
#: output, only a sign of life (the API turns it into an SSE ``: keep-alive`` comment).
KEEPALIVE = wire.DataChunk(req="")


class RequestFailed(Exception):
    """A request ended without a result. ``code`` is stable; ``status`` is the HTTP one."""

    def __init__(self, code: str, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


class ModelLoading(Exception):
    """The model's instance exists but is not ready within the wait."""

    def __init__(self, model: str, detail: str) -> None:
        super().__init__(f"model {model!r} is loading: {detail}")
        self.model = model
        self.detail = detail


def auto_instance_id(model: str) -> str:
    """Id of the instance placed on demand for ``model``: the same on every node, so
    nodes that place it at once write one instance, not one each (LWW keeps one plan)."""
    canon = models.canonical_name(model)
    return "auto-" + hashlib.blake2b(canon.encode(), digest_size=6).hexdigest()


@dataclass
class StageState:
    """What the cluster says about one stage of an instance."""

    node: str
    state: str
    reason: str
    addr: wire.Addr | None


class Inference:
    """Instance and request logic for one node. The node passes in what it owns."""

    def __init__(
        self,
        *,
        node_id: str,
        state: Callable[[], LWWMap],
        write: Callable[[str, object], None],
        delete: Callable[[str], None],
        is_live: Callable[[str], bool],
        is_alive: Callable[[str], bool],
        dataplane: DataPlane,
        metrics=None,
        load_wait: float = LOAD_WAIT_S,
        chunk_timeout: float = CHUNK_TIMEOUT_S,
        replay_wait: float = REPLAY_WAIT_S,
    ) -> None:
        self.node_id = node_id
        self._state = state
        self._write = write
        self._delete = delete
        self._is_live = is_live
        self._is_alive = is_alive
        self.dataplane = dataplane
        self.metrics = metrics
        self.load_wait = load_wait
        self.chunk_timeout = chunk_timeout
        self.replay_wait = replay_wait
        #: Set by the node's drain: the API refuses new requests (503 ``draining``).
        self.draining = False
        #: Set when the node stops with requests still open: each ends with this
        #: reason as a typed error instead of being cut by the server's shutdown.
        self._aborted: str | None = None
        self._facts: dict[str, ModelFacts] = {}
        self._unrepairable: set[tuple[str, int]] = set()
        self._facts_lock = asyncio.Lock()

    # -- models --------------------------------------------------------------------
    async def facts(self, model: str, cache_dir) -> ModelFacts:
        """Facts of a model held on this node (hashing runs off the event loop)."""
        canon = models.canonical_name(model)
        async with self._facts_lock:
            f = self._facts.get(canon)
            if f is None:
                try:
                    f = await asyncio.to_thread(_read_facts, canon, cache_dir)
                except models.ModelNotFoundError:
                    # Not on this disk: a live node that holds it may have said what it
                    # is (its card), which is all placement needs (it places on holders).
                    f = self.facts_from_peers(canon)
                    if f is None:
                        raise
                    return f  # not cached: the holder may change its file
                self._facts[canon] = f
            return f

    def facts_from_peers(self, model: str) -> ModelFacts | None:
        """Facts of ``model`` as a live node that holds it advertises them."""
        canon = models.canonical_name(model)
        for nid, c in sorted(cards(self._state()).items()):
            if not self._is_live(nid):
                continue
            for f in c.model_facts:
                if models.canonical_name(f.name) == canon:
                    return msgspec.structs.replace(f, name=model)
        return None

    def known_models(self) -> list[str]:
        """Models the cluster can serve: placed ones and those some node holds."""
        m = self._state()
        names = {models.canonical_name(i.spec.model) for i in instances(m).values()}
        for nid, c in cards(m).items():
            if self._is_live(nid):
                names.update(models.canonical_name(x) for x in c.models)
        return sorted(names)

    def is_known(self, model: str) -> bool:
        """A model some live node holds, or that an instance serves."""
        return models.canonical_name(model) in self.known_models()

    # -- instances -----------------------------------------------------------------
    def find_instance(self, model: str) -> Instance | None:
        """The instance serving ``model`` (ready ones first, then by id)."""
        canon = models.canonical_name(model)
        found = [
            i for i in instances(self._state()).values()
            if models.canonical_name(i.spec.model) == canon
        ]  # fmt: skip
        if not found:
            return None
        found.sort(key=lambda i: (not self.is_ready(i), i.id))
        return found[0]

    def serving(self, nid: str) -> bool:
        """Live and not draining: a node placement may give stages to."""
        h = healths(self._state()).get(nid)
        return self._is_live(nid) and (h is None or h.state == "up")

    def live_resources(self, facts: ModelFacts, model: str):
        """Resources of the serving nodes that hold ``model`` (placement's input)."""
        m = self._state()
        cs, hs = cards(m), healths(m)
        canon = models.canonical_name(model)
        holders = [
            nid for nid, c in cs.items()
            if self._is_live(nid) and (nid not in hs or hs[nid].state == "up")
            and (canon in {models.canonical_name(x) for x in c.models}
                 or "/" in model or model.endswith(".gguf"))
        ]  # fmt: skip
        return node_resources(cs, hs, holders)

    def relocatable(self, inst: Instance, without: str) -> bool:
        """Whether the serving nodes other than ``without`` can hold ``inst``."""
        if inst.facts is None:
            return False
        nodes = {
            k: v for k, v in self.live_resources(inst.facts, inst.spec.model).items()
            if k != without
        }  # fmt: skip
        try:
            place(InstanceSpec(model=inst.spec.model), inst.facts, nodes, previous=inst)
        except PlacementError:
            return False
        return True

    async def create_instance(
        self, spec: InstanceSpec, facts: ModelFacts, instance_id: str | None = None
    ) -> Instance:
        """Compute a plan and write it; raise :class:`PlacementError` when none fits."""
        nodes = self.live_resources(facts, spec.model)
        stages = place(spec, facts, nodes)
        inst = Instance(
            id=instance_id or secrets.token_hex(4),
            spec=spec,
            stages=stages,
            generation=1,
            facts=facts,
        )
        self._write(instance_key(inst.id), inst)
        log.info(
            "placed %s as %s: %s", spec.model, inst.id,
            ", ".join(f"{s.node}[{s.start}:{s.end}) {s.engine}" for s in stages),
        )  # fmt: skip
        return inst

    def gave_up_on(self, inst: Instance) -> dict[str, RunnerStatus]:
        """Nodes whose runner for ``inst`` was given up (crash loop, model missing), with
        that runner's status: its ``reason`` says why and when.

        The node keeps reporting a given-up runner in its heartbeat after the instance
        moved away (see ``Supervisor``), so the exclusion and its reason outlive the
        repair: placement never puts the stage back there, and the API and ``meshctl
        top`` can say why the node is not in the plan.
        """
        from .supervisor import gave_up

        out: dict[str, RunnerStatus] = {}
        for nid, h in sorted(healths(self._state()).items()):
            for r in h.runners:
                if r.instance == inst.id and gave_up(r) and nid not in out:
                    out[nid] = r
        return out

    def _repair_nodes(self, inst: Instance, strict: bool = False):
        """Placement's input for a repair of ``inst``: serving nodes that hold the model,
        less those that gave up on it (and, ``strict``, less the merely suspect ones)."""
        assert inst.facts is not None
        excluded = set(self.gave_up_on(inst))
        return {
            k: v for k, v in self.live_resources(inst.facts, inst.spec.model).items()
            if k not in excluded and (not strict or self._is_alive(k))
        }  # fmt: skip

    def unrepairable(self, inst: Instance, strict: bool = False) -> str | None:
        """Why ``inst`` cannot serve and cannot be repaired, or None.

        A stage is lost when its node is not live (``strict``: not alive, i.e. even
        suspect) or its runner was given up. When a stage is lost and placement finds
        no plan on the nodes left, the instance will not serve again by itself: a
        request should end now with this reason rather than wait for a repair that the
        repair loop (:meth:`repair`, the same inputs) will never write.
        """
        if inst.facts is None:
            return None
        gone = self.gave_up_on(inst)
        lost = [
            st.node for st in inst.stages
            if st.node in gone or not (self._is_alive if strict else self._is_live)(st.node)
        ]  # fmt: skip
        if not lost:
            return None
        try:
            place(InstanceSpec(model=inst.spec.model), inst.facts,
                  self._repair_nodes(inst, strict), previous=inst)  # fmt: skip
        except PlacementError as e:
            why = gone[lost[0]].reason if lost[0] in gone else "node not answering"
            return f"stage on node {lost[0]} lost ({why}); no repair possible: {e}"
        return None

    def repair(self) -> list[Instance]:
        """Re-place every instance with a stage on a node that is gone or gave up.

        Every survivor runs this on its own and, ``place`` being pure and sticky,
        computes the same plan; it is written with ``generation + 1`` and concurrent
        identical writes converge through the LWW map. Returns what this node wrote.
        Nodes that gave up a runner of the instance are left out of its plans for good
        (until the node restarts or the instance is deleted).
        """
        m = self._state()
        cs, hs = cards(m), healths(m)
        live = {n for n in cs if self._is_live(n) and (n not in hs or hs[n].state == "up")}
        wrote = []
        for inst in instances(m).values():
            if inst.facts is None:
                continue
            excluded = set(self.gave_up_on(inst))
            if not repair_needed(inst, live - excluded):
                continue
            # Pins and min_nodes shaped the first plan; a repair keeps what survives
            # where it is and serves with what is left rather than not at all.
            relaxed = InstanceSpec(model=inst.spec.model)
            try:
                stages = place(relaxed, inst.facts, self._repair_nodes(inst), previous=inst)
            except PlacementError as e:
                key = (inst.id, inst.generation)
                if key not in self._unrepairable:
                    self._unrepairable.add(key)
                    log.warning("instance %s cannot be repaired: %s", inst.id, e)
                continue
            if stages == inst.stages:
                continue
            new = Instance(
                id=inst.id, spec=inst.spec, stages=stages,
                generation=inst.generation + 1, facts=inst.facts,
            )  # fmt: skip
            self._write(instance_key(inst.id), new)
            wrote.append(new)
            log.info(
                "repaired %s (generation %d): %s%s", inst.id, new.generation,
                ", ".join(f"{s.node}[{s.start}:{s.end})" for s in stages),
                f" (left out: {', '.join(sorted(excluded))})" if excluded else "",
            )  # fmt: skip
        return wrote

    def delete_instance(self, instance_id: str) -> bool:
        """Delete an instance; False if there is none with that id."""
        if instance_id not in instances(self._state()):
            return False
        self._delete(instance_key(instance_id))
        return True

    def stage_states(self, inst: Instance) -> list[StageState]:
        """Each stage's runner state and address, from the nodes' heartbeats."""
        m = self._state()
        cs, hs = cards(m), healths(m)
        out = []
        for i, st in enumerate(inst.stages):
            card, h = cs.get(st.node), hs.get(st.node)
            state, reason, addr = "pending", "", None
            if card is None or not self._is_live(st.node):
                state, reason = "unavailable", f"node {st.node} is not live"
            elif h is not None:
                # Newest generation first: a given-up runner of an older plan may still
                # be reported beside the current one (it records why the node was left
                # out), and must not hide it.
                mine = [r for r in h.runners if r.instance == inst.id and r.stage == i]
                for r in sorted(mine, key=lambda r: -r.generation)[:1]:
                    state, reason = r.state, r.reason
                    if r.generation != inst.generation and r.state == "ready":
                        state = "loading"
                    if r.port:
                        addr = wire.Addr(node=st.node, addresses=card.addresses, port=r.port)
            out.append(StageState(st.node, state, reason, addr))
        return out

    def is_ready(self, inst: Instance) -> bool:
        """Every stage's runner is ready at the instance's generation."""
        return all(s.state == "ready" and s.addr is not None for s in self.stage_states(inst))

    async def ensure(self, model: str, cache_dir, wait: float | None = None) -> Instance:
        """The ready instance for ``model``, placing one if needed and waiting (bounded).

        Raises ``ModelLoading`` when it is not ready in time, ``RequestFailed`` when a
        stage failed, ``PlacementError`` when it cannot be placed.
        """
        inst = self.find_instance(model)
        if inst is None:
            facts = await self.facts(model, cache_dir)
            spec = InstanceSpec(model=models.canonical_name(model))
            inst = await self.create_instance(spec, facts, auto_instance_id(model))
        deadline = time.monotonic() + (self.load_wait if wait is None else wait)
        while True:
            cur = instances(self._state()).get(inst.id)
            if cur is None:
                raise RequestFailed("instance_deleted", f"instance {inst.id} was deleted", 503)
            states = self.stage_states(cur)
            if all(s.state == "ready" and s.addr for s in states):
                return cur
            # A stage that is gone (dead node, given-up runner) is repaired by the
            # repair loop within a second when the cluster can hold the instance; when
            # it cannot, nothing will change by waiting: say so now, with placement's
            # reason, instead of a 503 "loading" after the whole wait.
            why = self.unrepairable(cur)
            if why is not None:
                raise RequestFailed("stage_lost", f"instance {cur.id} of {model}: {why}", 503)
            failed = [s for s in states if s.state == "failed"]
            if failed and not self.gave_up_on(cur):
                raise RequestFailed(
                    "stage_failed",
                    f"instance {cur.id} of {model}: stage on {failed[0].node} failed: "
                    f"{failed[0].reason}",
                    503,
                )
            if self._aborted is not None:
                raise RequestFailed("node_stopping", self._aborted, 503)
            if time.monotonic() >= deadline:
                detail = ", ".join(f"{s.node}: {s.state}" for s in states)
                raise ModelLoading(model, detail)
            await asyncio.sleep(0.1)

    # -- requests ------------------------------------------------------------------
    async def generate(
        self,
        inst: Instance,
        *,
        messages: list[wire.ChatTurn] | None = None,
        prompt: str | None = None,
        sampling: wire.Sampling,
        replay: bool = True,
    ) -> AsyncIterator[wire.DataChunk]:
        """Run one request on ``inst``; yield its chunks until the final one.

        The first chunk carries ``n_prompt``; the last one ``finish_reason``. Raises
        :class:`RequestFailed` with a typed code when the request cannot complete.
        Closing the iterator early cancels the request on every stage.

        With ``replay``, a pipeline that breaks mid-request (a stage's node or runner
        gone, or the plan moved on under it: :data:`REPLAYABLE`) is not the end: the
        request is sent again on the instance's next plan with the tokens already
        produced, which are re-prefilled, and the output continues where it stopped
        (greedy output is the same as without the failure). While it waits for that
        plan, :data:`KEEPALIVE` is yielded every :data:`KEEPALIVE_S`. When no repair is
        possible it fails at once; a possible one gets ``replay_wait`` seconds.
        """
        sent: list[int] = []
        acked = False
        replays = 0
        while True:
            try:
                # aclosing: a caller that stops early (client gone) closes this
                # generator; the attempt's cancel to every stage must run then, not
                # whenever the garbage collector gets to it.
                attempt = self._attempt(inst, messages, prompt, sampling, sent)
                async with contextlib.aclosing(attempt) as chunks:
                    async for c in chunks:
                        if c.n_prompt is not None and not c.tokens and c.finish_reason is None:
                            if acked:
                                continue  # a replay's acknowledgement: the client has one
                            acked = True
                        sent.extend(c.tokens)
                        yield c
                return
            except RequestFailed as e:
                if e.code not in REPLAYABLE or not replay or replays >= MAX_REPLAYS:
                    raise
                replays += 1
                cause = e
            log.warning(
                "request on %s broke (%s: %s); replaying after %d tokens",
                inst.id, cause.code, cause.message, len(sent),
            )  # fmt: skip
            deadline = time.monotonic() + self.replay_wait
            beat = time.monotonic() + KEEPALIVE_S
            while True:
                cur = self._replay_target(inst, cause)
                if cur is not None:
                    inst = cur
                    break
                now = time.monotonic()
                if now >= deadline:
                    raise RequestFailed(
                        "stage_lost",
                        f"{cause.message}; not repaired in {self.replay_wait:.0f} s",
                    )
                if acked and now >= beat:
                    # Only once the client has its response: before that, nothing
                    # is on the wire to keep alive and the caller awaits the ack.
                    beat = now + KEEPALIVE_S
                    yield KEEPALIVE
                await asyncio.sleep(REPLAY_POLL_S)

    def _replay_target(self, inst: Instance, cause: RequestFailed) -> Instance | None:
        """The plan a broken request can be replayed on now, None to keep waiting, or
        :class:`RequestFailed` when waiting cannot help (checked every round, since
        what is possible changes while we wait: a stage fails, another node dies)."""
        if self._aborted is not None:
            raise RequestFailed("node_stopping", f"{cause.message}; {self._aborted}", 503)
        cur = instances(self._state()).get(inst.id)
        if cur is None:
            raise RequestFailed("instance_deleted", f"instance {inst.id} was deleted", 503)
        if self.is_ready(cur) and all(self._is_alive(s.node) for s in cur.stages):
            return cur
        # Strict: a node that is only suspect counts as lost here, so that a request
        # whose stage died ends within the bound (suspect after 1.2 s) when nothing
        # can take the stage, instead of waiting for the node to be declared dead.
        why = self.unrepairable(cur, strict=True)
        if why is not None:
            raise RequestFailed("stage_lost", f"{cause.message}; {why}")
        gone = self.gave_up_on(cur)
        for s in self.stage_states(cur):
            if s.state == "failed" and s.node not in gone:
                raise RequestFailed(
                    "stage_failed", f"{cause.message}; stage on {s.node} failed: {s.reason}"
                )
        return None

    async def _attempt(
        self,
        inst: Instance,
        messages: list[wire.ChatTurn] | None,
        prompt: str | None,
        sampling: wire.Sampling,
        resume: list[int],
    ) -> AsyncIterator[wire.DataChunk]:
        """One try of a request on one plan."""
        states = self.stage_states(inst)
        route = [s.addr for s in states]
        if any(a is None for a in route):
            raise RequestFailed("not_ready", f"instance {inst.id} is not ready", 503)
        req = secrets.token_hex(8)
        q = self.dataplane.open(req)
        done = False
        try:
            await self.dataplane.send(
                route[0],  # type: ignore[arg-type]
                wire.Generate(
                    req=req, instance=inst.id, generation=inst.generation,
                    route=route, reply_to=self.dataplane.reply_addr(),  # type: ignore[arg-type]
                    messages=messages, prompt=prompt, sampling=sampling,
                    resume_tokens=list(resume),
                ),
            )  # fmt: skip
            timeout = FIRST_CHUNK_TIMEOUT_S
            while True:
                chunk = await self._next(q, inst, timeout)
                timeout = self.chunk_timeout
                if chunk.error is not None:
                    bad_input = chunk.error.code in ("context_length_exceeded", "bad_prompt")
                    raise RequestFailed(
                        chunk.error.code, chunk.error.message, 400 if bad_input else 502
                    )
                if chunk.finish_reason is not None:
                    # The last stage released the request and started the release
                    # walk from stage 0: nothing is left to free.
                    done = True
                yield chunk
                if done:
                    return
        finally:
            self.dataplane.close(req)
            if not done:
                await self._release_everywhere(req, inst, route)  # type: ignore[arg-type]

    async def _release_everywhere(self, req: str, inst: Instance, route: list[wire.Addr]) -> None:
        """Free ``req``'s KV cache on every stage of ``route``, each told directly.

        A runner passes a cancel on down the chain, but a chain stops at a dead stage:
        the stages after it would keep the request's KV for good. So the API node tells
        each stage itself (a stage that already freed it, or hears it twice through the
        chain, ignores the extra one). A send to a dead stage only queues, bounded.
        """
        for addr in {(a.port, *a.addresses): a for a in route}.values():
            try:
                await self.dataplane.send(
                    addr, wire.Release(req=req, instance=inst.id, reason="cancel")
                )
            except Exception:
                log.debug("could not send cancel for %s to %s", req, addr.node)

    def abort(self, reason: str) -> None:
        """End every request this node's API still has open with ``node_stopping``
        (the node is stopping and cannot wait for them any longer)."""
        self._aborted = reason

    async def _next(self, q: asyncio.Queue[wire.DataChunk], inst: Instance, timeout: float):
        """Next chunk, watching the stages: a dead node or runner ends the wait at once."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            # Checked before every chunk: a stream whose tokens keep coming would
            # otherwise never see the node stopping under it.
            if self._aborted is not None:
                raise RequestFailed("node_stopping", self._aborted, 503)
            if not q.empty():  # the per-token path: no timer, no task
                return q.get_nowait()
            try:
                async with asyncio.timeout(LIVENESS_POLL_S):
                    return await q.get()
            except TimeoutError:
                pass
            now = time.monotonic()
            for s in self.stage_states(inst):
                if s.state != "ready":
                    raise RequestFailed(
                        "stage_lost",
                        f"stage on node {s.node} went away: {s.reason or s.state}",
                        502,
                    )
                if now - t0 >= SUSPECT_SILENCE_S and not self._is_alive(s.node):
                    raise RequestFailed(
                        "stage_lost", f"node {s.node} stopped answering mid-request", 502
                    )
            if now >= deadline:
                raise RequestFailed(
                    "timeout", f"no output from the pipeline in {timeout:.0f} s", 504
                )


def _read_facts(model: str, cache_dir) -> ModelFacts:
    from pathlib import Path

    from meshd.models.facts import read_facts

    resolved = models.resolve_model(model)
    if resolved.format == "mlx":
        from meshd.models.folder import read_folder_facts

        return read_folder_facts(Path(resolved.path), name=model, cache_dir=Path(cache_dir))
    return read_facts(Path(resolved.path), name=model, cache_dir=Path(cache_dir))

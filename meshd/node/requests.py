"""The request path on the node whose API took the request: send it down the pipeline,
hand back what comes out, replay it when a fault breaks the pipeline.

The route (every stage's runner address) comes from the shared state; ``Generate`` goes
to stage 0 and every ``DataChunk`` the stages send comes back on this node's data
plane. A request always ends with a result or a typed :class:`RequestFailed` within
bounds: a stage whose node or runner goes away ends it at once (woken by the cluster
change, not found by polling), a merely suspect one after ``suspect_silence`` of
silence, a silent pipeline after ``chunk_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable

import msgspec

from meshd.crdt.views import Instance
from meshd.domain.exact import settled
from meshd.domain.job import Job
from meshd.domain.keepalive import Awake, until
from meshd.logs import current_request
from meshd.transport import wire
from meshd.transport.dataplane import DataPlane

from .cluster import ClusterView
from .config import NodeConfig
from .errors import RequestFailed
from .state import ClusterState

__all__ = ["KEEPALIVE", "REPLAYABLE", "Requests", "replay_target"]

log = logging.getLogger("meshd.inference")

#: Errors that mean "this plan's pipeline broke", not "this request is bad": the
#: request is replayed on the instance's next plan. ``generation_mismatch`` is what a
#: runner answers once the plan moved on (a drain, a repair, a crash-loop move).
REPLAYABLE = frozenset(
    {"stage_lost", "generation_mismatch", "wrong_stage", "not_ready", "prefix_miss",
     "stage_fault"}
)  # fmt: skip

#: Yielded by :meth:`Requests.generate` while a request waits for its repair: no
#: output, only a sign of life (the API turns it into an SSE ``: keep-alive`` comment).
KEEPALIVE = wire.DataChunk(req="")

#: Put in an open request's queue when the cluster changed: look at the stages again.
_WAKE = wire.DataChunk(req="")


def replay_target(
    view: ClusterView, inst: Instance, cause: RequestFailed, aborted: str | None = None
) -> Instance | None:
    """The plan a broken request can be replayed on now, None to keep waiting, or
    :class:`RequestFailed` when waiting cannot help. Pure: asked again at every change
    of the cluster, since what is possible changes while a request waits (a stage
    fails, another node dies, the node stops: ``aborted``). A plan that still has the
    node whose output was corrupt (``cause.node``) waits: that node gives its runner
    up, and the repair moves the stage."""
    if aborted is not None:
        raise RequestFailed("node_stopping", f"{cause.message}; {aborted}", 503)
    cur = view.instances.get(inst.id)
    if cur is None:
        raise RequestFailed("instance_deleted", f"instance {inst.id} was deleted", 503)
    ready = view.is_ready(cur) and all(view.is_alive(s.node) for s in cur.stages)
    if ready and cause.node not in {s.node for s in cur.stages}:
        return cur
    # Strict: a node that is only suspect counts as lost here, so that a request
    # whose stage died ends within the bound (suspect after 1.2 s) when nothing
    # can take the stage, instead of waiting for the node to be declared dead.
    why = view.unrepairable(cur, strict=True)
    if why is not None:
        raise RequestFailed("stage_lost", f"{cause.message}; {why}")
    gone = view.gave_up_on(cur)
    for s in view.stage_states(cur):
        if s.state == "failed" and s.node not in gone:
            raise RequestFailed(
                "stage_failed", f"{cause.message}; stage on {s.node} failed: {s.reason}"
            )
    return None


class Requests:
    """Requests this node's API owns, from ``Generate`` to the last chunk."""

    def __init__(
        self,
        state: ClusterState,
        dataplane: DataPlane,
        config: NodeConfig,
        on_awake: Callable[[], None] = lambda: None,
    ) -> None:
        self.state = state
        #: Called when this node's word on an instance's keep-alive changed (it beats).
        self.on_awake = on_awake
        #: This node's word on each instance's keep-alive (see :meth:`awake`).
        self.said: dict[str, Awake] = {}
        self.dataplane = dataplane
        self.config = config
        #: Set when the node stops with requests still open: each ends with this
        #: reason as a typed error instead of being cut by the server's shutdown.
        self.aborted: str | None = None
        self._open: dict[str, asyncio.Queue[wire.DataChunk]] = {}
        #: Requests this node's API runs on each instance now (by instance id).
        self.load: dict[str, int] = {}
        #: Requests waiting for a sequence on their stage 0, and their place there.
        self.queued: dict[str, int] = {}
        state.changes.listen(self._wake)

    def keep_alive(self, instance: str, seconds: float | None) -> None:
        """This node's word on ``instance`` from now: keep it loaded ``seconds`` (None:
        the node's default; 0: unload it once no request runs on it), told to the nodes
        that run it in the next heartbeat, at once."""
        now = time.time()
        keep = self.config.keep_alive if seconds is None else seconds
        self.said[instance] = Awake(set_at=now, until=until(now, keep))
        self.on_awake()

    def wake(self, instance: str) -> None:
        """Have an unloaded instance loaded again (for the default keep-alive), unless
        this node's word already wants it loaded."""
        w = self.said.get(instance)
        if w is None or w.until <= time.time():
            self.keep_alive(instance, None)

    def awake(self) -> dict[str, Awake]:
        """This node's word on each instance it sent requests to (for its heartbeat):
        busy while a request of its runs on it."""
        placed = self.state.view().instances
        self.said = {i: w for i, w in self.said.items() if i in placed}
        out = dict(self.said)
        for i in self.load:
            w = out.get(i)
            out[i] = Awake(set_at=w.set_at if w else 0.0, until=w.until if w else 0.0, busy=True)
        return out

    def in_flight(self) -> int:
        """Requests this node owns now, those waiting for a replay's plan included (no
        pipeline is open for them then, but the drain must still wait for them)."""
        return sum(self.load.values())

    def abort(self, reason: str) -> None:
        """End every open request with ``node_stopping`` (the node is stopping and
        cannot wait for them any longer)."""
        self.aborted = reason
        self.state.changes.notify()

    def _wake(self) -> None:
        # An empty queue means its request waits for a chunk: wake it to look at the
        # stages. A queue with chunks in it is read at once anyway.
        for q in self._open.values():
            if q.empty():
                q.put_nowait(_WAKE)

    async def generate(
        self,
        inst: Instance,
        job: Job,
        *,
        replay: bool = True,
        keep_alive: float | None = None,
    ) -> AsyncGenerator[wire.DataChunk, None]:
        """Run one request on ``inst``; yield its chunks until the final one; then keep
        the instance loaded ``keep_alive`` seconds (None: the node's default). The first
        chunk carries ``n_prompt``; the last one ``finish_reason``. Raises
        :class:`RequestFailed` with a typed code when the request cannot complete.
        Closing the iterator early cancels the request on every stage. With ``replay``, a
        pipeline that breaks mid-request (a stage's node or runner gone, or the plan
        moved on under it: :data:`REPLAYABLE`) is not the end: the request is sent again
        on the instance's next plan with the tokens already produced, which are
        re-prefilled, and the output continues where it stopped (greedy output is the
        same as without the failure). While it waits for that plan, :data:`KEEPALIVE`
        is yielded every ``keepalive`` seconds. When no repair is possible it fails at
        once; a possible one gets ``replay_wait`` seconds.
        """
        # Replicas share the load: the least busy ready instance of the model takes it,
        # counted at once (no await in between), so a burst spreads evenly.
        picked = self.state.view().least_loaded(inst.spec.model, self.load)
        if picked is not None:
            inst = picked
        counted = inst.id
        self.load[counted] = self.load.get(counted, 0) + 1
        try:
            cfg = self.config
            sent: list[int] = []
            acked = False
            replays = 0
            while True:
                try:
                    # aclosing: a caller that stops early (client gone) closes this
                    # generator; the attempt's cancel to every stage must run then, not
                    # whenever the garbage collector gets to it.
                    attempt = self._attempt(inst, job, sent)
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
                    if e.code not in REPLAYABLE or not replay or replays >= cfg.max_replays:
                        raise
                    replays += 1
                    cause = e
                    # A replay computes its whole prompt: its output must continue
                    # exactly, and a stage may have lost the cached prefix.
                    job = msgspec.structs.replace(job, cache_prompt=False)
                log.warning(
                    "request on %s broke (%s: %s); replaying after %d tokens",
                    inst.id, cause.code, cause.message, len(sent),
                )  # fmt: skip
                deadline = time.monotonic() + cfg.replay_wait
                beat = time.monotonic() + cfg.keepalive
                while True:
                    cur = replay_target(self.state.view(), inst, cause, self.aborted)
                    if cur is not None:
                        inst = cur
                        break
                    now = time.monotonic()
                    if now >= deadline:
                        raise RequestFailed(
                            "stage_lost",
                            f"{cause.message}; not repaired in {cfg.replay_wait:.0f} s",
                        )
                    if acked and now >= beat:
                        # Only once the client has its response: before that, nothing
                        # is on the wire to keep alive and the caller awaits the ack.
                        beat = now + cfg.keepalive
                        yield KEEPALIVE
                    until = min(deadline, beat) if acked else deadline
                    await self.state.changes.wait(until - now)
        finally:
            self._uncount(counted, keep_alive)

    def _uncount(self, instance: str, keep_alive: float | None) -> None:
        self.load[instance] -= 1
        if not self.load[instance]:
            del self.load[instance]
        self.keep_alive(instance, keep_alive)
        # The drain waits for this node's requests to end.
        self.state.changes.notify()

    async def _attempt(
        self,
        inst: Instance,
        job: Job,
        resume: list[int],
    ) -> AsyncGenerator[wire.DataChunk, None]:
        """One try of a request on one plan."""
        view = self.state.view()
        addrs = [s.addr for s in view.stage_states(inst)]
        route = [a for a in addrs if a is not None]
        if len(route) < len(addrs):
            raise RequestFailed("not_ready", f"instance {inst.id} is not ready", 503)
        # The API request's id, when one is being served, prefixes the pipeline's own
        # (each attempt and each choice its own): grep finds the whole path by it.
        base = current_request()
        req = f"{base}.{secrets.token_hex(3)}" if base else secrets.token_hex(8)
        q = self.dataplane.open(req, view.senders(inst))
        self._open[req] = q
        done = False
        try:
            await self.dataplane.send(
                route[0],
                wire.Generate(
                    req=req, instance=inst.id, generation=inst.generation,
                    route=route, reply_to=self.dataplane.reply_addr(),
                    job=settled(job, inst.spec.exact), resume_tokens=list(resume),
                ),
            )  # fmt: skip
            timeout = self.config.first_chunk_timeout
            while True:
                chunk = await self._next(q, inst, timeout)
                timeout = self.config.chunk_timeout
                if chunk.queued:
                    # Its turn has not come: stage 0 is alive and says so every few
                    # seconds; a wait in the queue is no silence of the pipeline.
                    self.queued[req] = chunk.queued
                    continue
                self.queued.pop(req, None)
                if chunk.n_prompt and not chunk.tokens:
                    # The acknowledgement: the prefill of the prompt (and of a replay's
                    # tokens) comes next, silent and longer the longer the prompt.
                    prefill = chunk.n_prompt + len(resume)
                    timeout += prefill * self.config.prefill_s_per_token
                if chunk.error is not None:
                    bad_input = chunk.error.code in (
                        "context_length_exceeded",
                        "bad_prompt",
                        "bad_sampling",
                        "not_generative",
                        "no_projector",
                        "bad_image",
                    )
                    at = chunk.error.stage
                    full = chunk.error.code == "overloaded"  # stage 0's queue is full
                    raise RequestFailed(
                        chunk.error.code, chunk.error.message,
                        400 if bad_input else 429 if full else 502,
                        node=inst.stages[at].node if 0 <= at < len(inst.stages) else "",
                        n_prompt=chunk.n_prompt or 0,
                    )  # fmt: skip
                if chunk.finish_reason is not None:
                    # The last stage released the request and started the release
                    # walk from stage 0: nothing is left to free.
                    done = True
                yield chunk
                if done:
                    return
        finally:
            self._open.pop(req, None)
            self.queued.pop(req, None)
            self.dataplane.close(req)
            if not done:
                await self._release_everywhere(req, inst, route)

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

    async def _next(
        self, q: asyncio.Queue[wire.DataChunk], inst: Instance, timeout: float
    ) -> wire.DataChunk:
        """Next chunk, watching the stages: a dead node or runner ends the wait at once.

        The wait ends on a chunk, on a change of the cluster (:data:`_WAKE`), or at a
        time limit: the chunk timeout, or ``suspect_silence`` after the wait began when
        a stage's node is suspect (silent and suspect together mean it is gone).
        """
        t0 = time.monotonic()
        deadline = t0 + timeout
        silence = self.config.suspect_silence
        nodes = {s.node for s in inst.stages}
        while True:
            # Checked before every chunk: a stream whose tokens keep coming would
            # otherwise never see the node stopping under it.
            if self.aborted is not None:
                raise RequestFailed("node_stopping", self.aborted, 503)
            if not q.empty():  # the per-token path: no timer, no task
                chunk = q.get_nowait()
                if chunk is not _WAKE:
                    return chunk
            else:
                # A stage already suspect brings no change to wake us: wake ourselves.
                wake_at = deadline
                if not all(self.state.is_alive(n) for n in nodes):
                    wake_at = min(deadline, t0 + silence)
                chunk = None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, wake_at - time.monotonic())):
                        chunk = await q.get()
                if chunk is not None and chunk is not _WAKE:
                    return chunk
            now = time.monotonic()
            view = self.state.view()
            for s in view.stage_states(inst):
                if s.state != "ready":
                    raise RequestFailed(
                        "stage_lost",
                        f"stage on node {s.node} went away: {s.reason or s.state}",
                        502,
                    )
                if now - t0 >= silence and not view.is_alive(s.node):
                    raise RequestFailed(
                        "stage_lost", f"node {s.node} stopped answering mid-request", 502
                    )
            if now >= deadline:
                raise RequestFailed(
                    "timeout", f"no output from the pipeline in {timeout:.0f} s", 504
                )

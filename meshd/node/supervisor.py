"""Reconcile the runners this node runs with the stages the plans give it.

Desired state: every stage of every instance whose ``node`` is this node. Running
state: runner subprocesses, each reporting ``loading`` -> ``ready`` | ``failed`` on its
stdout. A runner whose stage changed range or model is replaced; one whose plan only
moved to a new generation keeps its weights and is told the new generation. Status
changes are pushed to the node (which puts them in its heartbeat).

A plan change never blocks on the runners it retires: they are stopped in the
background while the new plan's runners start, so a repair or a drain is not held up
by their stop grace. (A retired runner cannot serve the old plan's requests any
longer anyway: its neighbours moved to the new generation and refuse the old one; the
API node replays those requests on the new plan.)

A runner that is given up (crash loop, model missing, fetch failed, refused) is
remembered after its stage moved away: the node keeps reporting it, ``failed`` with
its reason, in its heartbeat until the instance is deleted or the node restarts. That
is what keeps the node out of the instance's plans (``ClusterView.repairs``) and what
the API and ``meshctl top`` show as the reason.

Slices of GGUF files cut for llama.cpp stages are cached in ``cache_dir``; after each
reconcile the slices no desired stage uses are trimmed to ``slice_cache`` bytes.

What the plans ask of this node (which stages, which it takes, the runner each needs)
is decided by the pure functions of :mod:`.stage_runners`; the supervisor is
configured by one :class:`~.supervisor_settings.SupervisorSettings`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from statistics import fmean

import msgspec

from meshd.crdt.views import Instance, RunnerStatus
from meshd.engines.protocol import (
    STAGE_FAULT,
    Failed,
    RunnerConfig,
    SetGeneration,
    SetMembers,
    SocketKeys,
    decode_event,
    encode,
    runner_command,
)
from meshd.engines.threads import runner_env, runner_spincount
from meshd.models.slicing import trim_slices
from meshd.transport.security import CurveKeys

from .cluster import CRASH_LOOP, MODEL_MISSING, REFUSED, gave_up
from .runner_procs import RunnerProc, decode_bps, is_placed_file, public_reason, tell_drafts
from .stage_fetch import Fetch, fetch_stage_slice
from .stage_runners import (
    Desired,
    StageId,
    StageKey,
    admit,
    desired_stages,
    gpu_layers,
    kept_prefix_rows,
    runner_config,
    send_dtype,
    slice_to_fetch,
    stage_key,
    stage_slice,
    undesired,
)
from .supervisor_settings import SupervisorSettings
from .watchdog import watch

__all__ = [
    "Fetch",
    "RunnerProc",
    "StageKey",
    "Supervisor",
    "SupervisorSettings",
    "decode_bps",
    "gpu_layers",
    "is_placed_file",
    "kept_prefix_rows",
    "public_reason",
    "send_dtype",
    "tell_drafts",
]

log = logging.getLogger("meshd.supervisor")


class Supervisor:
    """Starts, retunes and stops this node's runner subprocesses.

    Configured by one :class:`SupervisorSettings`; the rest are its collaborators:
    ``resolve_path`` (a model name -> this node's file, raising when there is none),
    ``on_status`` (called at every runner state change: the node beats soon), ``keys``
    (the cluster's, None in an open one), and ``fetch`` (a stage's slice from the nodes
    that hold the model; None: never), tried once ``fetchable(instance)`` says some
    live node serves it (waited for a while: :mod:`.stage_fetch`).
    """

    def __init__(
        self,
        node_id: str,
        settings: SupervisorSettings,
        *,
        resolve_path: Callable[[str], str],
        on_status: Callable[[], None],
        keys: CurveKeys | None = None,
        fetch: Fetch | None = None,
        fetchable: Callable[[Instance], bool] = lambda inst: True,
    ) -> None:
        self.node_id = node_id
        self.settings = settings
        self.resolve_path = resolve_path
        self.on_status = on_status
        self.keys = keys
        self.fetch = fetch
        self.fetchable = fetchable
        #: Member id -> CURVE key (Z85): whom runners admit and how they dial a node.
        self.members: dict[str, bytes] = {}
        self.runners: dict[StageId, RunnerProc] = {}
        #: Runners given up for a corrupt output, and ended for a stall, by instance
        #: (``meshd_stage_faults``, ``meshd_stage_stalls``).
        self.stage_faults: dict[str, int] = {}
        self.stalls: dict[str, int] = {}
        #: Stages the plans give this node (its cores are split among them).
        self.n_runners = 0
        #: Given-up runners whose stage moved away, by instance (see the module doc).
        self.given_up: dict[str, RunnerStatus] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()
        self._scheduled = False
        self._closed = False
        self._reconciles: set[asyncio.Task[None]] = set()

    def schedule(self, instances: Callable[[], dict[str, Instance]]) -> None:
        """Reconcile soon with what ``instances()`` says then (a burst of plan changes
        is one reconcile; a change during a reconcile is another)."""
        if self._scheduled:
            return
        self._scheduled = True

        async def run() -> None:
            await asyncio.sleep(0)  # coalesce a burst of changes
            self._scheduled = False
            await self.reconcile(instances())

        t = asyncio.get_running_loop().create_task(run(), name="reconcile")
        self._reconciles.add(t)
        t.add_done_callback(self._reconciles.discard)

    def active(self) -> int:
        """Requests holding KV on this node's runners now (whichever node owns them)."""
        return sum(r.active for r in self.runners.values())

    def statuses(self) -> list[RunnerStatus]:
        """Every runner's state, for the heartbeat, and the runners given up here."""
        live = [r.status() for _, r in sorted(self.runners.items())]
        return live + [self.given_up[i] for i in sorted(self.given_up)]

    async def reconcile(self, instances: dict[str, Instance]) -> None:
        """Make the running set match the plans (idempotent; serialized): retire the
        stages no plan gives this node, bring each one it gives to its plan (in the
        plans' order, one at a time), then trim the slice cache."""
        async with self._lock:
            if self._closed:
                return
            desired = desired_stages(instances, self.node_id)
            # An instance deleted: its exclusions go with it.
            self.given_up = {k: v for k, v in self.given_up.items() if k in instances}
            self.n_runners = len(desired)
            self._retire_undesired(desired)
            s = self.settings
            admitted = admit(desired, set(self.runners), s.max_runners, s.memory)
            for k, (inst, i) in desired.items():
                if k in admitted:
                    await self._follow_plan(k, inst, i)
                else:
                    await self._refuse(k, inst, i)
            await self._trim_slices(desired)

    def _retire_undesired(self, desired: Desired) -> None:
        """Stop (in the background) the runners of stages no plan gives this node any
        more; a given-up one is remembered, so its exclusion outlives the move."""
        for k in undesired(self.runners, desired):
            r = self.runners.pop(k)
            self._remember_given_up(r)
            self._retire(r)

    def _remember_given_up(self, r: RunnerProc) -> None:
        if gave_up(r.status()):
            self.given_up.setdefault(r.key.instance, r.status())

    async def _refuse(self, k: StageId, inst: Instance, i: int) -> None:
        """Report a stage this node does not take (over its runner count or memory)
        ``failed`` as refused, stopping what ran for it (said once, not every time)."""
        r = self.runners.get(k)
        if r is not None and r.reason.startswith(REFUSED):
            return
        if r is not None:
            await self._stop(r)
        why = f"{REFUSED}: more stages than this node takes"
        log.warning("stage %s/%d: %s", inst.id, i, why)
        self.runners[k] = _failed(inst, i, why)
        self.on_status()

    async def _follow_plan(self, k: StageId, inst: Instance, i: int) -> None:
        """Bring stage ``i`` of ``inst`` to its plan: keep its runner (told a new
        generation), or replace it, or start one (its slice fetched first if need be)."""
        weights = await self._weights(k, inst, i)
        if weights is None:
            return  # reported failed: the model is neither here nor to be fetched
        path, sliced = weights
        key = stage_key(inst, i, path, self.settings.n_ctx)
        r = self.runners.get(k)
        if r is not None and r.key == key:
            if r.generation != inst.generation:
                self._retune(r, inst.generation)
            return
        if r is not None:
            # Same slot, other weights: stop first (both at once might not fit in
            # memory; placement counted the new one in place of the old).
            self._remember_given_up(r)
            await self._stop(r)
        await self._launch(k, key, inst, sliced)

    async def _weights(self, k: StageId, inst: Instance, i: int) -> tuple[str, bool] | None:
        """What stage ``i`` loads: ``(path, False)``, the placed file here; ``(path,
        True)``, its slice fetched from the holders, when there is no file of the model
        here or, with a fetch to fall back on, another file than the placed one; None
        when neither (then the stage is reported ``failed``, the model missing)."""
        level = logging.DEBUG  # a model not here: the fetch says once it starts
        try:
            path = self.resolve_path(inst.spec.model)
            if not self.fetch or await is_placed_file(
                path, inst.facts, self.settings.cache_dir, self.runners.get(k)
            ):
                return path, False
            why, level = f"{path} here is another file than the placed one", logging.INFO
        except Exception as e:
            why = str(e)
        fetched = self._slice_to_fetch(inst, i)
        if fetched is None:
            # What was looked at stays in this node's log: a reason travels in the
            # heartbeat; the disk's contents are nobody else's business.
            log.info("stage %s/%d: %s", inst.id, i, why)
            self._report_missing(k, inst, i)
            return None
        why = why.partition("\n")[0]
        log.log(level, "stage %s/%d: %s: its slice comes from the holders", inst.id, i, why)
        return str(fetched), True

    def _slice_to_fetch(self, inst: Instance, i: int) -> Path | None:
        """Where stage ``i``'s slice goes when fetched, or None when it cannot be (no
        fetcher, or facts that name no file). Whether a holder is live is asked when
        the fetch starts (:func:`.stage_fetch.await_holder`)."""
        if self.fetch is None:
            return None
        return slice_to_fetch(self.settings.cache_dir, inst, i)

    def _report_missing(self, k: StageId, inst: Instance, i: int) -> None:
        r = self.runners.get(k)
        if r is None or r.state != "failed":
            self.runners[k] = _failed(inst, i, MODEL_MISSING)
            self.on_status()

    async def _launch(self, k: StageId, key: StageKey, inst: Instance, sliced: bool) -> None:
        """Start a runner of ``key``, or fetch its slice first where it is not here."""
        cfg = runner_config(
            key, inst, self.settings,
            n_runners=self.n_runners, keys=self._socket_keys(), sliced=sliced,
        )  # fmt: skip
        if sliced and not Path(key.model_path).exists():
            self.runners[k] = self._fetching(key, cfg, inst, key.stage)
        else:
            self.runners[k] = await self._start(key, cfg)
        layer_bytes = inst.facts.active_layer_bytes()[key.start : key.end] if inst.facts else []
        if layer_bytes:
            self.runners[k].layer_bytes = fmean(layer_bytes)

    async def _trim_slices(self, desired: Desired) -> None:
        keep = [
            stage_slice(self.settings.cache_dir, inst.facts, st.start, st.end)
            for inst, i in desired.values()
            if inst.facts is not None and inst.facts.sha256  # "": it names no slice
            for st in [inst.stages[i]]
        ]
        try:
            gone = await asyncio.to_thread(
                trim_slices, self.settings.cache_dir, keep, self.settings.slice_cache
            )
        except OSError as e:
            log.warning("slice cache: %s", e)
            return
        for path in gone:
            log.info("slice cache: removed %s (unused, cache over its quota)", path)

    def _socket_keys(self) -> SocketKeys | None:
        if self.keys is None:
            return None
        return SocketKeys.of(self.keys, self.members or {self.node_id: self.keys.public})

    def set_members(self, members: dict[str, bytes]) -> None:
        """The members the runners' sockets deal with from now on (every runner is told
        at once; a runner started later gets them in its config)."""
        self.members = dict(members)
        line = encode(SetMembers(members={n: k.decode() for n, k in members.items()})) + b"\n"
        for r in self.runners.values():
            if r.proc is not None and r.proc.stdin is not None and r.proc.returncode is None:
                r.proc.stdin.write(line)

    def _fetching(self, key: StageKey, cfg: RunnerConfig, inst: Instance, i: int) -> RunnerProc:
        r = RunnerProc(key, cfg, state="fetching", generation=cfg.generation)
        r.tasks.append(asyncio.create_task(self._fetch_then_spawn(r, inst, i)))
        self.on_status()
        return r

    async def _fetch_then_spawn(self, r: RunnerProc, inst: Instance, i: int) -> None:
        """Fetch the stage's slice, then start its runner (unless it was retired)."""
        assert self.fetch is not None
        if not await fetch_stage_slice(r, inst, i, self.fetch, self.fetchable, self.on_status):
            return
        async with self._lock:
            if r.state == "stopped" or self._closed:
                return
            if self.runners.get((r.key.instance, r.key.stage)) is r:
                await self._spawn(r)

    async def _start(self, key: StageKey, cfg: RunnerConfig) -> RunnerProc:
        r = RunnerProc(key, cfg, generation=cfg.generation)
        await self._spawn(r)
        return r

    async def _spawn(self, r: RunnerProc) -> None:
        key, cfg = r.key, msgspec.structs.replace(r.config, generation=r.generation)
        r.state, r.port, r.active, r.waiting, r.draft, r.stall = "loading", 0, 0, 0, None, ""
        # Its context is said: an operator sees the (memory-chosen) default take effect.
        log.info(
            "starting runner %s stage %d [%d, %d), %d tokens of context%s",
            key.instance, key.stage, key.start, key.end, cfg.n_ctx,
            f" with a {cfg.kv_cache} KV cache" if cfg.kv_cache != "f16" else "",
        )  # fmt: skip
        argv, config_line = runner_command(cfg)
        r.proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=runner_env(minimal=True, spincount=runner_spincount(cfg.n_stages, self.n_runners)),
            # Its own session: Ctrl-C at the terminal or a SIGTERM to the node's process
            # group reaches the node only, which drains before it stops its runners
            # (a runner also ends when its stdin closes, so a killed node leaves none).
            start_new_session=True,
        )  # fmt: skip
        assert r.proc.stdin is not None
        r.proc.stdin.write(config_line)
        r.tasks.append(asyncio.create_task(self._watch(r)))
        self.on_status()

    async def _watch(self, r: RunnerProc) -> None:
        assert r.proc is not None and r.proc.stdout is not None
        dog = asyncio.create_task(watch(r, lambda why: self._stalled(r, why)))
        while True:
            line = await r.proc.stdout.readline()
            if not line:
                dog.cancel()
                break
            ev = decode_event(line)
            if not r.take(ev):
                continue
            if isinstance(ev, Failed) and r.reason.startswith(STAGE_FAULT):
                self._give_up_faulty(r)
            self.on_status()
        code = await r.proc.wait()
        if r.state == "stopped" or r.reason.startswith(STAGE_FAULT):
            return
        failed = r.reason if r.state == "failed" else ""
        reason = r.stall or failed or f"exited with code {code}"
        now = asyncio.get_running_loop().time()
        r.crashes = [t for t in r.crashes if now - t < self.settings.restart_window] + [now]
        if len(r.crashes) > self.settings.max_restarts:
            r.state = "failed"
            # When, in the reason itself: it travels in the heartbeat and is shown by
            # the API and `meshctl top` long after the stage moved away.
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            r.reason = (
                f"{CRASH_LOOP}: {len(r.crashes)} exits in {self.settings.restart_window:.0f} s "
                f"({reason}); given up at {at}"
            )
            log.error("runner %s stage %d given up: %s", r.key.instance, r.key.stage, r.reason)
            self.on_status()
            return
        delay = 0.0 if r.stall else self.settings.restart_backoff * 2 ** (len(r.crashes) - 1)
        log.warning(
            "runner %s stage %d %s; restarting in %.1f s",
            r.key.instance, r.key.stage, reason, delay,
        )  # fmt: skip
        r.state, r.reason = "loading", f"restarting after: {reason}"
        self.on_status()
        await asyncio.sleep(delay)
        if r.state != "stopped" and self.runners.get((r.key.instance, r.key.stage)) is r:
            await self._spawn(r)

    def _give_up_faulty(self, r: RunnerProc) -> None:
        """A runner whose output was corrupt is given up at once, not restarted: the
        stage moves (a replay of the same computation here would fault again), and the
        heartbeat keeps saying why."""
        self.stage_faults[r.key.instance] = self.stage_faults.get(r.key.instance, 0) + 1
        r.reason += time.strftime("; given up at %Y-%m-%dT%H:%M:%SZ", time.gmtime())
        r.signal(kill=False)

    def _stalled(self, r: RunnerProc, why: str) -> None:
        """A runner that makes no progress ends now (SIGKILL: a stopped process heeds
        nothing else) and restarts, at once; its requests replay meanwhile."""
        self.stalls[r.key.instance] = self.stalls.get(r.key.instance, 0) + 1
        log.warning("runner %s stage %d %s: ending it", r.key.instance, r.key.stage, why)
        r.stall, r.state, r.reason = why, "loading", f"restarting after: {why}"
        self.on_status()
        r.signal(kill=True)

    def _retune(self, r: RunnerProc, generation: int) -> None:
        r.generation = generation
        if r.proc is not None and r.proc.stdin is not None:
            r.proc.stdin.write(encode(SetGeneration(value=generation)) + b"\n")
        self.on_status()

    async def _stop(self, r: RunnerProc) -> None:
        r.state = "stopped"
        p = r.proc
        if p is not None and p.returncode is None:
            r.signal(kill=False)
            try:
                await asyncio.wait_for(p.wait(), self.settings.stop_grace)
            except TimeoutError:
                r.signal(kill=True)
                await p.wait()
        for t in r.tasks:
            t.cancel()
        self.on_status()

    def _retire(self, r: RunnerProc) -> None:
        """Stop ``r`` in the background: a plan change must not wait for its grace."""
        r.state = "stopped"  # its watcher must not restart it meanwhile
        t = asyncio.get_running_loop().create_task(self._stop(r))
        self._retiring.add(t)
        t.add_done_callback(self._retiring.discard)

    async def stop_all(self) -> None:
        """Stop every runner (node shutdown)."""
        self._closed = True  # no reconcile starts a runner after this
        async with self._lock:
            runners = [self.runners.pop(k) for k in list(self.runners)]
            await asyncio.gather(*(self._stop(r) for r in runners), *list(self._retiring))


def _failed(inst: Instance, i: int, reason: str) -> RunnerProc:
    st = inst.stages[i]
    key = StageKey(inst.id, i, len(inst.stages), st.start, st.end, "", st.engine)
    cfg = RunnerConfig(
        instance=inst.id, generation=inst.generation, stage=i, n_stages=len(inst.stages),
        model_path="", sha256="", start=st.start, end=st.end, n_layers=st.end, cache_dir="",
    )  # fmt: skip
    return RunnerProc(key, cfg, state="failed", reason=reason, generation=inst.generation)

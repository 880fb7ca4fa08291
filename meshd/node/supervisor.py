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

A runner that is given up (crash loop, model missing) is remembered after its stage
moved away: the node keeps reporting it, ``failed`` with its reason, in its heartbeat
until the instance is deleted or the node restarts. That is what keeps the node out
of the instance's plans (``ClusterView.repairs``) and what the API and ``meshctl top``
show as the reason.

Slices of GGUF files cut for llama.cpp stages are cached in ``cache_dir``; after each
reconcile the slices no desired stage uses are trimmed to ``slice_cache`` bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

import msgspec

from meshd.crdt.views import Instance, ModelFacts, RunnerStatus
from meshd.engines.attention import pipeline_kept_rows
from meshd.engines.protocol import (
    Failed,
    Listening,
    Load,
    Ready,
    RunnerConfig,
    SetDraft,
    SetGeneration,
    SetMembers,
    SocketKeys,
    decode_event,
    encode,
    runner_command,
)
from meshd.engines.threads import runner_env, runner_spincount, threads_per_runner
from meshd.logs import configured
from meshd.models.folder import folder_sha256
from meshd.models.folder_slicing import folder_slice_dir
from meshd.models.hashing import file_sha256
from meshd.models.slicing import slice_path, trim_slices
from meshd.placement import instance_context, node_vram, stage_offload
from meshd.placement.place import KV_SEQUENCES, KV_TOKENS
from meshd.transport import wire
from meshd.transport.security import ClusterKeys

from .cluster import CRASH_LOOP, FETCH_FAILED, MODEL_MISSING, REFUSED, gave_up
from .config import (
    MAX_RESTARTS,
    MAX_RUNNERS,
    REQUEST_EXPIRY_S,
    RESTART_BACKOFF_S,
    RESTART_WINDOW_S,
    SLICE_CACHE_BYTES,
    STOP_GRACE_S,
    STREAM_INTERVAL_S,
)

log = logging.getLogger("meshd.supervisor")

#: ``fetch(instance, stage index, destination, on_progress)``: the stage's slice from
#: the nodes that hold the model, verified, at the destination (raises when it cannot).
Fetch = Callable[[Instance, int, Path, Callable[[int, int, float], None]], Awaitable[object]]
#: Fetch progress is pushed into the heartbeat at most this often.
FETCH_BEAT_S = 1.0


@dataclass(frozen=True)
class StageKey:
    """What makes two runners interchangeable (same weights, same place in the chain)."""

    instance: str
    stage: int
    n_stages: int
    start: int
    end: int
    model_path: str
    engine: str = "llama_cpp"
    #: Wire type of the activations sent on: it depends on the next stage's engine.
    send_dtype: str = "f32"
    #: Context per request the runner allocates (a repair may change it: see
    #: ``placement.default_context``); 0 where it is not known yet.
    n_ctx: int = 0


@dataclass
class RunnerProc:
    key: StageKey
    config: RunnerConfig
    proc: asyncio.subprocess.Process | None = None
    state: str = "loading"
    reason: str = ""
    port: int = 0
    generation: int = 0
    active: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    #: Monotonic times of unexpected exits (crash-loop breaker).
    crashes: list[float] = field(default_factory=list)
    #: While fetching its slice: bytes verified, of the total, and the rate.
    fetched: int = 0
    fetch_total: int = 0
    fetch_rate: float = 0.0
    #: Milliseconds per layer of its decode steps, and the mean bytes of its layers:
    #: together, how fast this machine reads weights (``Supervisor.decode_bps``).
    layer_ms: float = 0.0
    layer_bytes: float = 0.0
    #: The draft model its process was told to ask (stage 0): instance and address.
    draft: tuple[str, wire.Addr] | None = None
    #: Tokens it drafted for other models' requests (a draft model's runner).
    proposed: int = 0

    def status(self) -> RunnerStatus:
        fetching = self.state == "fetching"
        return RunnerStatus(
            instance=self.key.instance,
            generation=self.generation,
            stage=self.key.stage,
            state=self.state,  # type: ignore[arg-type]
            reason=self.reason,
            port=self.port,
            active=self.active,
            fetched=self.fetched if fetching else 0,
            fetch_total=self.fetch_total if fetching else 0,
            fetch_rate=round(self.fetch_rate, 1) if fetching else 0.0,
        )


_PATH = re.compile(r"(?<![\w.])(?:~|/)[^\s'\"():,]*")


def public_reason(reason: str) -> str:
    """A runner's failure as it may travel in the heartbeat: paths replaced, so that no
    peer learns what is on this node's disk (the node's own log keeps the whole text)."""
    return _PATH.sub("<path>", reason)[:300]


def stage_slice(cache_dir: Path, facts: ModelFacts, start: int, end: int) -> Path:
    """Where this node keeps the slice of ``[start, end)`` a stage loads: a sub-GGUF
    (cut here or fetched) or the folder of an MLX model's range (fetched)."""
    if facts.format == "mlx":
        return folder_slice_dir(cache_dir, facts.sha256, start, end)
    return slice_path(cache_dir, facts.sha256, start, end)


async def is_placed_file(
    path: str, facts: ModelFacts | None, cache_dir: Path, running: RunnerProc | None = None
) -> bool:
    """Whether the local file is the placed one (by sha256, cached by path, size and
    mtime); True when that cannot be told here (the runner checks again), or when a
    runner already runs on it (checked before it started, not at every reconcile)."""
    if facts is None or not facts.sha256:
        return True
    if running is not None and running.key.model_path == path:
        return True
    p = Path(path)
    digest = folder_sha256 if p.is_dir() else file_sha256
    try:
        local = await asyncio.to_thread(digest, p, cache_dir)
    except OSError:
        return True  # the runner says what is wrong with it
    return local == facts.sha256


def slice_to_fetch(cache_dir: Path, inst: Instance, i: int) -> Path | None:
    """Where stage ``i``'s slice goes when this node lacks the model and fetches it (a
    sub-GGUF, or an MLX folder's range), else None (nothing to fetch it by)."""
    facts = inst.facts
    if facts is None or not facts.sha256:
        return None
    st = inst.stages[i]
    return stage_slice(cache_dir, facts, st.start, st.end)


def send_dtype(inst: Instance, i: int) -> str:
    """Wire type of the activations stage ``i`` sends: the spec's choice on a hop
    between two MLX stages, float32 on every other hop."""
    stages = inst.stages
    if i + 1 < len(stages) and stages[i].engine == "mlx" and stages[i + 1].engine == "mlx":
        return inst.spec.activations
    return "f32"


def decode_bps(runners: Iterable[RunnerProc]) -> float:
    """Bytes of weights a decode step reads per second here, as this node's ready
    runners measured it (their mean, by layer bytes); 0.0 before any measured.

    Decode reads every weight once a step, so the rate is the machine's, not the
    model's: placement predicts any model's ms per layer from it."""
    timed = [r for r in runners if r.state == "ready" and r.layer_ms > 0 and r.layer_bytes > 0]
    if not timed:
        return 0.0
    rate = fmean(r.layer_bytes / (r.layer_ms / 1000) for r in timed)
    return float(f"{rate:.3g}")


def _vram(inst: Instance, i: int) -> int:
    """GPU bytes placement counted for stage ``i`` on its node, from the node as the
    plan saw it (``PlanBasis``); 0 without one."""
    st = inst.stages[i]
    node = next((n for n in inst.basis.nodes if n.id == st.node), None) if inst.basis else None
    return 0 if node is None else node_vram(node, st.engine)


def gpu_layers(inst: Instance, i: int) -> int:
    """``n_gpu_layers`` of stage ``i``'s runner: what placement counted on its node's
    GPUs (0, the CPU, without one)."""
    st = inst.stages[i]
    if inst.facts is None:
        return 0
    return stage_offload(
        inst.facts, st.start, st.end, st.engine, _vram(inst, i),
        context=instance_context(inst), kv_cache=inst.spec.kv_cache,
    ).layers  # fmt: skip


def kept_prefix_rows(inst: Instance) -> int:
    """Rows after which every stage of ``inst`` drops a prefix kept unused: one figure
    for all, from the plan, so none drops a prefix that stage 0 still names."""
    return pipeline_kept_rows(
        (st.engine, inst.spec.kv_cache, gpu_layers(inst, i)) for i, st in enumerate(inst.stages)
    )


def tell_drafts(
    runners: Iterable[RunnerProc], pick: Callable[[str], tuple[str, wire.Addr] | None]
) -> None:
    """Tell each stage 0 among ``runners`` the draft model ``pick(instance)`` names
    for its instance, where that changed (see ``meshd.placement.drafts``)."""
    for r in runners:
        p = r.proc
        if r.key.stage != 0 or p is None or p.stdin is None or p.returncode is not None:
            continue
        choice = pick(r.key.instance)
        if choice != r.draft:
            r.draft = choice
            iid, addr = choice if choice else (None, None)
            p.stdin.write(encode(SetDraft(instance=iid, addr=addr)) + b"\n")


def admit(
    desired: Mapping[tuple[str, int], tuple[Instance, int]],
    running: set[tuple[str, int]],
    max_runners: int,
    memory: int,
) -> set[tuple[str, int]]:
    """The stages a node takes: at most ``max_runners``, and no more host memory than
    ``memory`` (0: no bound), whatever a plan says (running stages first, then by id)."""
    admitted: set[tuple[str, int]] = set()
    total = 0
    for k in sorted(desired, key=lambda k: (k not in running, k)):
        inst, i = desired[k]
        st = inst.stages[i]
        need = 0
        if inst.facts is not None:
            need = stage_offload(
                inst.facts, st.start, st.end, st.engine, _vram(inst, i),
                context=instance_context(inst), kv_cache=inst.spec.kv_cache,
            ).host_need  # fmt: skip
        if len(admitted) >= max_runners or (memory and total + need > memory):
            continue
        total += need
        admitted.add(k)
    return admitted


class Supervisor:
    """Starts, retunes and stops this node's runner subprocesses."""

    def __init__(
        self,
        node_id: str,
        *,
        resolve_path: Callable[[str], str],
        cache_dir: Path,
        bind_host: str,
        on_status: Callable[[], None],
        n_ctx: int = KV_TOKENS,
        n_seq_max: int = KV_SEQUENCES,
        keys: ClusterKeys | None = None,
        max_tokens: int | None = None,
        max_runners: int = MAX_RUNNERS,
        memory: int = 0,
        slice_cache: int = SLICE_CACHE_BYTES,
        request_expiry: float = REQUEST_EXPIRY_S,
        stream_interval: float = STREAM_INTERVAL_S,
        stop_grace: float = STOP_GRACE_S,
        max_restarts: int = MAX_RESTARTS,
        restart_window: float = RESTART_WINDOW_S,
        restart_backoff: float = RESTART_BACKOFF_S,
        fetch: Fetch | None = None,
        fetchable: Callable[[Instance], bool] = lambda inst: True,
    ) -> None:
        self.node_id = node_id
        #: Fetches a stage's slice from the nodes that hold the model (None: never),
        #: when ``fetchable(instance)`` says some live node serves it.
        self.fetch = fetch
        self.fetchable = fetchable
        self.keys = keys
        self.max_tokens = max_tokens
        #: At most this many stages here, needing at most ``memory`` bytes (0: no cap).
        self.max_runners = max_runners
        self.memory = memory
        self.slice_cache = slice_cache
        #: The members' client keys (Z85): what runners admit.
        self.members: list[bytes] = []
        self.resolve_path = resolve_path
        self.cache_dir = cache_dir
        self.bind_host = bind_host
        self.on_status = on_status
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.request_expiry = request_expiry
        self.stream_interval = stream_interval
        self.stop_grace = stop_grace
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.restart_backoff = restart_backoff
        self.runners: dict[tuple[str, int], RunnerProc] = {}
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
        """Make the running set match the plans (idempotent; serialized)."""
        async with self._lock:
            if self._closed:
                return
            desired: dict[tuple[str, int], tuple[Instance, int]] = {}
            for inst in instances.values():
                for i, st in enumerate(inst.stages):
                    if st.node == self.node_id:
                        desired[(inst.id, i)] = (inst, i)
            for iid in list(self.given_up):
                if iid not in instances:
                    del self.given_up[iid]  # instance deleted: forget the exclusion
            self.n_runners = len(desired)
            for k in list(self.runners):
                if k not in desired:
                    r = self.runners.pop(k)
                    if gave_up(r.status()):
                        self.given_up.setdefault(k[0], r.status())
                    self._retire(r)
            admitted = self._admit(desired)
            for k, (inst, i) in desired.items():
                st = inst.stages[i]
                facts = inst.facts
                if k not in admitted:
                    r = self.runners.get(k)
                    if r is None or not r.reason.startswith(REFUSED):
                        if r is not None:
                            await self._stop(r)
                        why = f"{REFUSED}: more stages than this node takes"
                        log.warning("stage %s/%d: %s", inst.id, i, why)
                        self.runners[k] = _failed(inst, i, why)
                        self.on_status()
                    continue
                sliced = False
                try:
                    path = self.resolve_path(inst.spec.model)
                    known = self.runners.get(k)
                    if self.fetch and not await is_placed_file(path, facts, self.cache_dir, known):
                        raise LookupError(f"{path} here is another file than the placed one")
                except Exception as e:
                    fetchable = self.fetch is not None and self.fetchable(inst)
                    fetched = slice_to_fetch(self.cache_dir, inst, i) if fetchable else None
                    if fetched is None:
                        # What was looked at stays in this node's log: a reason travels
                        # in the heartbeat; the disk's contents are nobody else's business.
                        log.info("stage %s/%d: %s", inst.id, i, e)
                        r = self.runners.get(k)
                        if r is None or r.state != "failed":
                            self.runners[k] = _failed(inst, i, MODEL_MISSING)
                            self.on_status()
                        continue
                    if k not in self.runners:  # said once, not at every reconcile
                        log.info("stage %s/%d: %s: its slice comes from the holders",
                                 inst.id, i, e)  # fmt: skip
                    path, sliced = str(fetched), True
                n_ctx = inst.context or inst.spec.context or self.n_ctx
                key = StageKey(
                    inst.id, i, len(inst.stages), st.start, st.end, path,
                    st.engine, send_dtype(inst, i), n_ctx,
                )  # fmt: skip
                r = self.runners.get(k)
                if r is not None and r.key == key:
                    if r.generation != inst.generation:
                        self._retune(r, inst.generation)
                    continue
                if r is not None:
                    # Same slot, other weights: stop first (both at once might not fit
                    # in memory; placement counted the new one in place of the old).
                    if gave_up(r.status()):
                        self.given_up.setdefault(inst.id, r.status())
                    await self._stop(r)
                cfg = RunnerConfig(
                    instance=inst.id,
                    generation=inst.generation,
                    stage=i,
                    n_stages=len(inst.stages),
                    model_path=path,
                    sha256=facts.sha256 if facts else "",
                    start=st.start,
                    end=st.end,
                    n_layers=facts.n_layers if facts else st.end,
                    engine=st.engine,
                    cache_dir=str(self.cache_dir),
                    bind_host=self.bind_host,
                    # The context placement chose for the instance.
                    n_ctx=n_ctx,
                    n_seq_max=self.n_seq_max,
                    kv_cache=inst.spec.kv_cache,
                    speculate=inst.spec.speculate,
                    n_gpu_layers=gpu_layers(inst, i),
                    kept_prefix_rows=kept_prefix_rows(inst),
                    send_dtype=send_dtype(inst, i),
                    n_threads=threads_per_runner(self.n_runners),
                    request_expiry_s=self.request_expiry,
                    stream_interval_s=self.stream_interval,
                    max_tokens=self.max_tokens,
                    keys=self._socket_keys(),
                    # As this process logs (`meshd up --log-level/--log-format`): the
                    # runners write to its stderr, and its log must read as one.
                    log_level=configured()[0],
                    log_format=configured()[1],
                    sliced=sliced,
                )
                if sliced and not Path(path).exists():
                    self.runners[k] = self._fetching(key, cfg, inst, i)
                else:
                    self.runners[k] = await self._start(key, cfg)
                if facts is not None and facts.layer_bytes[st.start : st.end]:
                    self.runners[k].layer_bytes = fmean(facts.layer_bytes[st.start : st.end])
            await self._trim_slices(desired)

    def _admit(self, desired: dict[tuple[str, int], tuple[Instance, int]]) -> set[tuple[str, int]]:
        return admit(desired, set(self.runners), self.max_runners, self.memory)

    async def _trim_slices(self, desired: dict[tuple[str, int], tuple[Instance, int]]) -> None:
        keep = [
            stage_slice(self.cache_dir, inst.facts, st.start, st.end)
            for inst, i in desired.values()
            if inst.facts is not None
            for st in [inst.stages[i]]
        ]
        try:
            gone = await asyncio.to_thread(trim_slices, self.cache_dir, keep, self.slice_cache)
        except OSError as e:
            log.warning("slice cache: %s", e)
            return
        for path in gone:
            log.info("slice cache: removed %s (unused, cache over its quota)", path)

    def _socket_keys(self) -> SocketKeys | None:
        if self.keys is None:
            return None
        return SocketKeys.of(self.keys, self.members or [self.keys.client_public])

    def set_members(self, keys: list[bytes]) -> None:
        """The client keys the runners' sockets admit from now on (every runner is told
        at once; a runner started later gets them in its config)."""
        self.members = list(keys)
        line = encode(SetMembers(keys=[k.decode() for k in keys])) + b"\n"
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
        beat = 0.0

        def progress(done: int, total: int, rate: float) -> None:
            nonlocal beat
            r.fetched, r.fetch_total, r.fetch_rate = done, total, rate
            now = time.monotonic()
            if now - beat >= FETCH_BEAT_S:
                beat = now
                self.on_status()

        t0 = time.monotonic()
        log.info("stage %s/%d: fetching its slice [%d, %d) from the nodes that hold %s",
                 inst.id, i, r.key.start, r.key.end, inst.spec.model)  # fmt: skip
        try:
            await self.fetch(inst, i, Path(r.config.model_path), progress)
        except Exception as e:
            if r.state == "stopped":
                return
            r.state, r.reason = "failed", f"{FETCH_FAILED}: {public_reason(str(e))}"
            log.warning("stage %s/%d: %s", inst.id, i, r.reason)
            self.on_status()
            return
        log.info(
            "stage %s/%d: slice fetched, %d bytes in %.1f s",
            inst.id, i, r.fetch_total, time.monotonic() - t0,
        )  # fmt: skip
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
        r.state, r.port, r.active, r.draft = "loading", 0, 0, None
        log.info(
            "starting runner %s stage %d [%d, %d)%s",
            key.instance,
            key.stage,
            key.start,
            key.end,
            f" with a {cfg.kv_cache} KV cache" if cfg.kv_cache != "f16" else "",
        )
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
        while True:
            line = await r.proc.stdout.readline()
            if not line:
                break
            ev = decode_event(line)
            if isinstance(ev, Listening):
                r.port = ev.port
            elif isinstance(ev, Ready):
                r.state, r.layer_ms = "ready", ev.layer_ms
                log.info("runner %s stage %d ready on port %d (%.3f ms a layer)",
                         r.key.instance, r.key.stage, r.port, r.layer_ms)  # fmt: skip
            elif isinstance(ev, Load):
                r.active, r.proposed = ev.active, ev.proposed
                r.layer_ms = ev.layer_ms or r.layer_ms
            elif isinstance(ev, Failed):
                r.state, r.reason = "failed", public_reason(ev.reason)
                log.warning("runner %s stage %d failed: %s", r.key.instance, r.key.stage, r.reason)
            elif ev is None:
                continue
            self.on_status()
        code = await r.proc.wait()
        if r.state == "stopped":
            return
        reason = r.reason if r.state == "failed" and r.reason else f"exited with code {code}"
        now = asyncio.get_running_loop().time()
        r.crashes = [t for t in r.crashes if now - t < self.restart_window] + [now]
        if len(r.crashes) > self.max_restarts:
            r.state = "failed"
            # When, in the reason itself: it travels in the heartbeat and is shown by
            # the API and `meshctl top` long after the stage moved away.
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            r.reason = (
                f"{CRASH_LOOP}: {len(r.crashes)} exits in {self.restart_window:.0f} s "
                f"({reason}); given up at {at}"
            )
            log.error("runner %s stage %d given up: %s", r.key.instance, r.key.stage, r.reason)
            self.on_status()
            return
        delay = self.restart_backoff * 2 ** (len(r.crashes) - 1)
        log.warning(
            "runner %s stage %d %s; restarting in %.1f s",
            r.key.instance, r.key.stage, reason, delay,
        )  # fmt: skip
        r.state, r.reason = "loading", f"restarting after: {reason}"
        self.on_status()
        await asyncio.sleep(delay)
        if r.state != "stopped" and self.runners.get((r.key.instance, r.key.stage)) is r:
            await self._spawn(r)

    def _retune(self, r: RunnerProc, generation: int) -> None:
        r.generation = generation
        if r.proc is not None and r.proc.stdin is not None:
            r.proc.stdin.write(encode(SetGeneration(value=generation)) + b"\n")
        self.on_status()

    async def _stop(self, r: RunnerProc) -> None:
        r.state = "stopped"
        p = r.proc
        if p is not None and p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
            try:
                await asyncio.wait_for(p.wait(), self.stop_grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
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

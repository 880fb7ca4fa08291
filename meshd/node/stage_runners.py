"""The runners a node's share of the plans calls for, as pure functions over plans: which
stages the plans give this node and which of them it takes (:func:`desired_stages`,
:func:`admit`), where a stage's weights go when fetched, and what the runner of each
one is (:class:`StageKey`) and starts with (:func:`runner_config`).

No process, no socket, no clock: the :class:`~.supervisor.Supervisor` acts on these
answers, and a test can ask them with literals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from meshd.crdt.views import Instance
from meshd.domain.facts import ModelFacts
from meshd.engines.attention import pipeline_kept_rows
from meshd.engines.protocol import RunnerConfig, SocketKeys
from meshd.engines.threads import threads_per_runner
from meshd.logs import configured
from meshd.models.folder_slicing import folder_slice_dir
from meshd.models.slicing import slice_path
from meshd.placement import instance_context, node_vram, stage_offload

from .supervisor_settings import SupervisorSettings

__all__ = [
    "Desired",
    "StageId",
    "StageKey",
    "admit",
    "desired_stages",
    "gpu_layers",
    "kept_prefix_rows",
    "runner_config",
    "send_dtype",
    "slice_to_fetch",
    "stage_key",
    "stage_slice",
    "undesired",
]


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


def stage_slice(cache_dir: Path, facts: ModelFacts, start: int, end: int) -> Path:
    """Where this node keeps the slice of ``[start, end)`` a stage loads: a sub-GGUF
    (cut here or fetched) or the folder of an MLX model's range (fetched)."""
    if facts.format == "mlx":
        return folder_slice_dir(cache_dir, facts.sha256, start, end)
    return slice_path(cache_dir, facts.sha256, start, end)


def slice_to_fetch(cache_dir: Path, inst: Instance, i: int) -> Path | None:
    """Where stage ``i``'s slice goes when this node lacks the model and fetches it (a
    sub-GGUF, or an MLX folder's range), else None (nothing to fetch it by)."""
    facts = inst.facts
    if facts is None or not facts.sha256:
        return None
    st = inst.stages[i]
    return stage_slice(cache_dir, facts, st.start, st.end)


def send_dtype(inst: Instance, i: int) -> str:
    """Wire type of the activations stage ``i`` sends its requests' rows as: the spec's
    choice (every engine takes float32 rows in, whatever crossed the wire), float32
    for an instance in the exact mode. A request in the exact mode sends float32 on
    any hop (the runner decides per request: ``wire.Start.exact``)."""
    last = i + 1 >= len(inst.stages)  # sends no rows
    return "f32" if last or inst.spec.exact else inst.spec.activations


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
        inst.facts, st.start, st.end, st.engine, _vram(inst, i), seats=inst.spec.seats,
        context=instance_context(inst), kv_cache=inst.spec.kv_cache,
    ).layers  # fmt: skip


def kept_prefix_rows(inst: Instance) -> int:
    """Rows after which every stage of ``inst`` drops a prefix kept unused: one figure
    for all, from the plan, so none drops a prefix that stage 0 still names."""
    return pipeline_kept_rows(
        (st.engine, inst.spec.kv_cache, gpu_layers(inst, i)) for i, st in enumerate(inst.stages)
    )


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
                inst.facts, st.start, st.end, st.engine, _vram(inst, i), seats=inst.spec.seats,
                context=instance_context(inst), kv_cache=inst.spec.kv_cache,
            ).host_need  # fmt: skip
        if len(admitted) >= max_runners or (memory and total + need > memory):
            continue
        total += need
        admitted.add(k)
    return admitted


#: A stage by instance id and index: how the supervisor keys its runners.
StageId = tuple[str, int]
#: The stages the plans give this node, each with its instance and index.
Desired = dict[StageId, tuple[Instance, int]]


def desired_stages(instances: Mapping[str, Instance], node_id: str) -> Desired:
    """Every stage whose plan puts it on ``node_id``, in the plans' order."""
    return {
        (inst.id, i): (inst, i)
        for inst in instances.values()
        for i, st in enumerate(inst.stages)
        if st.node == node_id
    }


def undesired(running: Iterable[StageId], desired: Mapping[StageId, object]) -> list[StageId]:
    """The running stages that no plan gives this node any more (to retire)."""
    return [k for k in running if k not in desired]


def stage_key(inst: Instance, i: int, path: str, n_ctx: int) -> StageKey:
    """What a runner of stage ``i`` of ``inst`` on the weights at ``path`` is; ``n_ctx``
    is the context where neither the plan nor the spec names one."""
    st = inst.stages[i]
    context = inst.context or inst.spec.context or n_ctx
    return StageKey(
        inst.id, i, len(inst.stages), st.start, st.end, path,
        st.engine, send_dtype(inst, i), context,
    )  # fmt: skip


def runner_config(
    key: StageKey,
    inst: Instance,
    settings: SupervisorSettings,
    *,
    n_runners: int,
    keys: SocketKeys | None,
    sliced: bool,
) -> RunnerConfig:
    """The config a new runner of ``key`` (a stage of ``inst``) starts with, on a node
    that runs ``n_runners`` stages (its cores are split among them)."""
    i, facts = key.stage, inst.facts
    st = inst.stages[i]
    # As this process logs (`meshd up --log-level/--log-format`): the runners write
    # to its stderr, and its log must read as one.
    log_level, log_format = configured()
    return RunnerConfig(
        instance=inst.id,
        generation=inst.generation,
        stage=i,
        n_stages=len(inst.stages),
        model_path=key.model_path,
        sha256=facts.sha256 if facts else "",
        start=st.start,
        end=st.end,
        n_layers=facts.n_layers if facts else st.end,
        engine=st.engine,
        cache_dir=str(settings.cache_dir),
        bind_host=settings.bind_host,
        n_ctx=key.n_ctx,  # the context placement chose for the instance
        n_seq_max=inst.spec.seats or settings.n_seq_max,
        kv_cache=inst.spec.kv_cache,
        speculate=inst.spec.speculate,
        n_gpu_layers=gpu_layers(inst, i),
        kept_prefix_rows=kept_prefix_rows(inst),
        send_dtype=key.send_dtype,
        n_threads=threads_per_runner(n_runners),
        request_expiry_s=settings.request_expiry,
        stream_interval_s=settings.stream_interval,
        max_tokens=settings.max_tokens,
        keys=keys,
        log_level=log_level,
        log_format=log_format,
        sliced=sliced,
    )

"""GPUs in placement: a node's dedicated GPU memory takes the layers llama.cpp would
offload there (the last ones first, each with its KV, then the output head), so a
model that does not fit its RAM fits RAM + GPU; unified memory is RAM; the errors say
what each node offers; the cards, the cluster view and the runners agree.

No GPU on these machines: the cards are written here, and the offload rule is written
out again below (``offload``) independently of ``meshd.placement``.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from meshd.crdt.views import Instance, InstanceSpec, PlanBasis, Stage
from meshd.domain.facts import ModelFacts
from meshd.domain.nodes import Device, NodeResources
from meshd.node.supervisor import gpu_layers
from meshd.placement import PlacementError, Policy, node_vram, place, stage_need, stage_offload
from meshd.placement.resources import less_gpu

MiB = 1 << 20
GiB = 1 << 30
POLICY = Policy()

# An 8B-like model at 4 bits: 32 blocks of 120 MiB, separate head, GQA 8 x 128.
EIGHT_B = ModelFacts(
    name="llama-8b-q4",
    sha256="1" * 64,
    n_layers=32,
    hidden_size=4096,
    n_ctx_train=4096,
    layer_bytes=[120 * MiB] * 32,
    embed_bytes=280 * MiB,
    head_bytes=400 * MiB,
    kv_bytes_per_token_layer=2 * 8 * 128 * 2,
    engines=["llama_cpp", "mlx"],
)
KV_LAYER = EIGHT_B.kv_bytes_per_token_layer * 4096 * POLICY.kv_sequences  # 128 MiB
LAYER = math.ceil(120 * MiB * POLICY.weight_overhead) + KV_LAYER


def gpu(free: int, backend: str = "llama_cpp-cuda", name: str = "CUDA0", **kw) -> Device:
    return Device(backend=backend, name=name, mem_total=free, mem_free=free, **kw)


def node(nid: str, ram: int, devices: list[Device] = (), backends=None) -> NodeResources:  # type: ignore[assignment]
    if backends is None:
        backends = ["llama_cpp-cpu", *sorted({d.backend for d in devices})]
    return NodeResources(
        id=nid, name=nid, backends=backends, mem_available=ram, devices=list(devices)
    )


def offload(vram: int, start: int, end: int, last: bool) -> tuple[int, int]:
    """The rule as documented: last layers first while they fit, then the head."""
    k = used = 0
    for _ in range(end - start):
        if used + LAYER > vram:
            return k, used
        used, k = used + LAYER, k + 1
    if last and used + EIGHT_B.head_bytes <= vram:
        return k + 1, used + EIGHT_B.head_bytes
    return k, used


def test_a_stage_offloads_its_last_layers_first_then_the_head() -> None:
    need = stage_need(EIGHT_B, 0, 32, "llama_cpp")
    for vram in (0, LAYER - 1, LAYER, 10 * LAYER + 5, 32 * LAYER, 32 * LAYER + 400 * MiB):
        assert stage_offload(EIGHT_B, 0, 32, "llama_cpp", vram)[:2] == offload(vram, 0, 32, True)
    assert stage_offload(EIGHT_B, 0, 32, "llama_cpp", 32 * LAYER + 400 * MiB)[0] == 33
    # A middle stage has no head to offload: all its layers is all there is.
    assert stage_offload(EIGHT_B, 8, 16, "llama_cpp", 100 * GiB)[:2] == (8, 8 * LAYER)
    # MLX stages do not offload this way (their GPU, Metal, is unified memory).
    assert stage_offload(EIGHT_B, 0, 32, "mlx", 100 * GiB) == (0, 0, need)
    # The KV of an offloaded layer follows its context.
    n, used, _ = stage_offload(EIGHT_B, 0, 32, "llama_cpp", 4 * LAYER, context=2048)
    assert n > 4 and used <= 4 * LAYER
    assert 9 * GiB < need < 10 * GiB


def test_gpu_memory_lets_a_node_hold_what_its_ram_cannot_and_the_error_says_both() -> None:
    need = stage_need(EIGHT_B, 0, 32, "llama_cpp")
    spec = InstanceSpec(model=EIGHT_B.name)
    # 4 GiB of RAM alone is far too little for ~9 GiB.
    cpu = node("cpu", 4 * GiB)
    with pytest.raises(PlacementError) as e:
        place(spec, EIGHT_B, {"cpu": cpu})
    assert "GPU" not in str(e.value)
    # The same RAM beside a 12 GiB GPU: the layers and the head go there.
    box = node("box", 4 * GiB, [gpu(12 * GiB)])
    assert node_vram(box, "llama_cpp") == 12 * GiB - POLICY.vram_floor_bytes
    assert place(spec, EIGHT_B, {"box": box}) == [
        Stage(node="box", start=0, end=32, engine="llama_cpp")
    ]
    n, used, host = stage_offload(EIGHT_B, 0, 32, "llama_cpp", node_vram(box, "llama_cpp"))
    assert n == 33 and host == need - used <= box.mem_available
    # A 4 GiB GPU: part of the model only; RAM must take the rest, and the error names
    # both what the node offers in RAM and on its GPU.
    small = node("small", 4 * GiB, [gpu(4 * GiB)])
    with pytest.raises(PlacementError) as e:
        place(spec, EIGHT_B, {"small": small})
    msg = str(e.value)
    assert e.value.reason == "insufficient_memory"
    assert "3.5 GiB usable + 3.5 GiB of GPU memory" in msg, msg
    # ... and a bigger RAM makes up for it: a partial offload.
    mixed = node("mixed", 8 * GiB, [gpu(4 * GiB)])
    (stage,) = place(spec, EIGHT_B, {"mixed": mixed})
    assert (stage.start, stage.end) == (0, 32)
    k, _, _ = stage_offload(EIGHT_B, 0, 32, "llama_cpp", node_vram(mixed, "llama_cpp"))
    assert 0 < k < 32


def test_two_gpus_add_up_each_keeping_its_floor_and_unified_memory_is_ram() -> None:
    two = node("two", 4 * GiB, [gpu(6 * GiB), gpu(6 * GiB, name="CUDA1")])
    assert node_vram(two, "llama_cpp") == 12 * GiB - 2 * POLICY.vram_floor_bytes
    assert len(place(InstanceSpec(model=EIGHT_B.name), EIGHT_B, {"two": two})) == 1
    # A Mac: Metal shares the host's memory, which mem_available already counts.
    mac = node("mac", 4 * GiB, [gpu(12 * GiB, "llama_cpp-metal", "Metal", unified=True)])
    assert node_vram(mac, "llama_cpp") == 0
    with pytest.raises(PlacementError):
        place(InstanceSpec(model=EIGHT_B.name), EIGHT_B, {"mac": mac})
    # A GPU of another engine's backend does nothing for llama.cpp, nor a CPU-only
    # llama.cpp for a GPU it does not drive.
    mlx = node("m", 4 * GiB, [gpu(12 * GiB, "mlx-cuda", "cuda")], ["llama_cpp-cpu", "mlx-cuda"])
    assert node_vram(mlx, "llama_cpp") == 0
    cpu_only = node("c", 4 * GiB, [gpu(12 * GiB)], ["llama_cpp-cpu"])
    assert node_vram(cpu_only, "llama_cpp") == 0


def test_gpu_memory_ranks_a_node_and_shares_a_split() -> None:
    spec = InstanceSpec(model=EIGHT_B.name, min_nodes=2)
    a = node("a", 6 * GiB, [gpu(8 * GiB)])
    b = node("b", 6 * GiB)
    stages = place(spec, EIGHT_B, {"a": a, "b": b})
    assert [s.node for s in stages] == ["a", "b"]
    # The GPU node, with twice the room, takes more layers.
    assert stages[0].end - stages[0].start > stages[1].end - stages[1].start


def test_gpu_memory_in_use_is_taken_from_the_devices_in_order() -> None:
    r = node("a", 4 * GiB, [gpu(3 * GiB), gpu(3 * GiB, name="CUDA1"),
                            gpu(8 * GiB, "llama_cpp-metal", "Metal", unified=True)])  # fmt: skip
    less = less_gpu(r, 4 * GiB)
    assert [d.mem_free for d in less.devices] == [0, 2 * GiB, 8 * GiB]
    assert less_gpu(r, 0) is r


def test_the_runner_offloads_what_placement_counted_on_its_node() -> None:
    box = node("box", 4 * GiB, [gpu(6 * GiB)])
    cpu = node("cpu", 16 * GiB)
    spec = InstanceSpec(model=EIGHT_B.name, nodes=["box", "cpu"])
    stages = place(spec, EIGHT_B, {"box": box, "cpu": cpu})
    inst = Instance(id="i", spec=spec, stages=stages, facts=EIGHT_B,
                    basis=PlanBasis(spec=spec, nodes=[box, cpu]))  # fmt: skip
    want = stage_offload(EIGHT_B, stages[0].start, stages[0].end, "llama_cpp",
                         node_vram(box, "llama_cpp")).layers  # fmt: skip
    assert gpu_layers(inst, 0) == want > 0
    assert gpu_layers(inst, 1) == 0  # no GPU there
    assert gpu_layers(msgspec.structs.replace(inst, basis=None), 0) == 0  # CPU by default

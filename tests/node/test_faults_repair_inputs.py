"""Survivors repair from the same inputs: heartbeat memory figures are quantized."""

from __future__ import annotations

from meshd.crdt.views import Health, Instance, InstanceSpec, NodeCard, Stage
from meshd.domain.facts import ModelFacts
from meshd.placement import node_resources, place
from meshd.placement.resources import MEM_QUANTUM, quantize_mem

MiB = 1024**2
GiB = 1024**3
FACTS = ModelFacts(
    name="m", sha256="0" * 64, n_layers=30, hidden_size=576, n_ctx_train=8192,
    layer_bytes=[40 * MiB] * 30, embed_bytes=50 * MiB, engines=["llama_cpp"],
)  # fmt: skip


def _card(nid: str, total: int) -> NodeCard:
    return NodeCard(
        id=nid, name=nid, incarnation="i", cluster="c", version="0", os="linux",
        arch="x86_64", cpu_count=2, mem_total=total, mem_available=total,
        backends=["llama_cpp-cpu"], mesh_port=1, pub_port=2, api_port=3,
    )  # fmt: skip


def test_quantize_rounds_down_to_the_larger_of_256_mib_and_a_sixteenth_of_total() -> None:
    assert quantize_mem(5 * GiB + 300 * MiB, 16 * GiB) == 5 * GiB
    assert quantize_mem(700 * MiB, 2 * GiB) == 512 * MiB
    assert quantize_mem(700 * MiB) == 2 * MEM_QUANTUM
    assert quantize_mem(-1) == 0


def test_two_survivors_with_slightly_different_heartbeats_compute_the_same_repair() -> None:
    cards = {n: _card(n, 8 * GiB) for n in ("n1", "n2", "n3")}
    before = Instance(
        id="x", spec=InstanceSpec(model="m"), generation=3, facts=FACTS,
        stages=[Stage(node="n1", start=0, end=10, engine="llama_cpp"),
                Stage(node="n2", start=10, end=20, engine="llama_cpp"),
                Stage(node="n3", start=20, end=30, engine="llama_cpp")],
    )  # fmt: skip

    def snapshot(wobble: int) -> dict:
        # n2 died; n1 and n3 read each other's heartbeats a few hundred ms apart,
        # when free memory has moved by a few MiB.
        hs = {
            "n1": Health(seq=7, mem_available=3 * GiB + 100 * MiB + wobble),
            "n3": Health(seq=9, mem_available=2 * GiB + 40 * MiB - wobble),
        }
        return node_resources(cards, hs, live=["n1", "n3"])

    seen_by_n1, seen_by_n3 = snapshot(0), snapshot(37 * MiB)
    assert seen_by_n1 == seen_by_n3
    plan1 = place(InstanceSpec(model="m"), FACTS, seen_by_n1, previous=before)
    plan3 = place(InstanceSpec(model="m"), FACTS, seen_by_n3, previous=before)
    assert plan1 == plan3
    assert {s.node for s in plan1} <= {"n1", "n3"}

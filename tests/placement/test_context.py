"""An instance's context: placement reserves KV for it, says its arithmetic when it does
not fit, keeps it through a repair, and refuses one the model was not trained for."""

from __future__ import annotations

import pytest

from meshd.crdt.views import Instance, InstanceSpec
from meshd.placement import PlacementError, Policy, instance_context, place, stage_need
from tests.placement.test_place import BIG, SMOL, GiB, node

CPU = ["llama_cpp-cpu"]


def test_the_kv_reservation_follows_the_context() -> None:
    kv = SMOL.kv_bytes_per_token_layer * Policy().kv_sequences * SMOL.n_layers
    default = stage_need(SMOL, 0, 30, "llama_cpp")
    assert stage_need(SMOL, 0, 30, "llama_cpp", context=8192) - default == 4096 * kv
    assert default - stage_need(SMOL, 0, 30, "llama_cpp", context=1024) == 3072 * kv
    assert instance_context(InstanceSpec(model="m"), SMOL) == 4096
    assert instance_context(InstanceSpec(model="m", context=1024), SMOL) == 1024


def test_a_long_context_needs_more_nodes_and_says_why_when_it_cannot_fit() -> None:
    nodes = {n.id: n for n in (node("a", "a", CPU, 80 * GiB), node("b", "b", CPU, 80 * GiB))}
    assert len(place(InstanceSpec(model=BIG.name), BIG, nodes)) == 1
    # 16k tokens x 8 requests of KV (40 GiB) does not fit beside the weights on one node.
    assert len(place(InstanceSpec(model=BIG.name, context=16384), BIG, nodes)) == 2
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model=BIG.name, context=131072), BIG, nodes)
    assert e.value.reason == "insufficient_memory"
    assert "KV for 131072 tokens x 8 requests" in str(e.value)
    assert "a smaller context needs less" in str(e.value)


def test_a_context_past_the_trained_one_is_refused() -> None:
    nodes = {"a": node("a", "a", CPU, 48 * GiB)}
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model=SMOL.name, context=16384), SMOL, nodes)
    assert e.value.reason == "bad_spec" and "1 to 8192 tokens" in str(e.value)


def test_a_repair_keeps_the_context() -> None:
    spec = InstanceSpec(model=SMOL.name, nodes=["a", "b"], context=2048)
    assert spec.relaxed() == InstanceSpec(model=SMOL.name, context=2048)
    nodes = {n.id: n for n in (node("a", "a", CPU, 8 * GiB), node("b", "b", CPU, 8 * GiB))}
    stages = place(spec, SMOL, nodes)
    inst = Instance(id="i", spec=spec, stages=stages, generation=1, facts=SMOL)
    left = {"a": nodes["a"]}
    repaired = place(spec.relaxed(), SMOL, left, previous=inst)
    assert [s.node for s in repaired] == ["a"]


def test_a_quantized_kv_cache_reserves_its_own_bytes_and_fits_a_longer_context() -> None:
    kv = SMOL.kv_bytes_per_token_layer * Policy().kv_sequences * SMOL.n_layers * 4096
    f16 = stage_need(SMOL, 0, 30, "llama_cpp")
    assert f16 - stage_need(SMOL, 0, 30, "llama_cpp", kv_cache="q8_0") == kv - kv * 34 // 64
    assert f16 - stage_need(SMOL, 0, 30, "llama_cpp", kv_cache="q4_0") == kv - kv * 18 // 64
    # An MLX stage keeps its own cache type: the option changes nothing there.
    assert stage_need(SMOL, 0, 30, "mlx", kv_cache="q4_0") == stage_need(SMOL, 0, 30, "mlx")
    nodes = {n.id: n for n in (node("a", "a", CPU, 80 * GiB), node("b", "b", CPU, 80 * GiB))}
    assert len(place(InstanceSpec(model=BIG.name, context=16384), BIG, nodes)) == 2
    spec = InstanceSpec(model=BIG.name, context=16384, kv_cache="q8_0")
    assert len(place(spec, BIG, nodes)) == 1
    assert spec.relaxed().kv_cache == "q8_0"  # a repair keeps it
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model=BIG.name, context=131072), BIG, nodes)
    assert "(f16 on llama.cpp)" in str(e.value) and "kv_cache q8_0" in str(e.value)
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model=BIG.name, kv_cache="q5_1"), BIG, nodes)
    assert e.value.reason == "bad_spec"

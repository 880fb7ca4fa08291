"""An instance's context: placement reserves KV for it, says its arithmetic when it does
not fit, keeps it through a repair, and refuses one the model was not trained for."""

from __future__ import annotations

import msgspec
import pytest

from meshd.crdt.views import Instance, InstanceSpec
from meshd.placement import (
    PlacementError,
    Policy,
    default_context,
    instance_context,
    place,
    placement,
    stage_need,
)
from tests.placement.test_place import BIG, SMOL, GiB, node

CPU = ["llama_cpp-cpu"]


def test_the_kv_reservation_follows_the_context() -> None:
    kv = SMOL.kv_bytes_per_token_layer * Policy().kv_sequences * SMOL.n_layers
    default = stage_need(SMOL, 0, 30, "llama_cpp")
    assert stage_need(SMOL, 0, 30, "llama_cpp", context=8192) - default == 4096 * kv
    assert default - stage_need(SMOL, 0, 30, "llama_cpp", context=1024) == 3072 * kv
    plain = Instance(id="i", spec=InstanceSpec(model="m"), stages=[], facts=SMOL)
    assert instance_context(plain) == 4096  # a record from before the context was kept
    assert instance_context(msgspec.structs.replace(plain, context=8192)) == 8192
    asked = msgspec.structs.replace(plain, spec=InstanceSpec(model="m", context=1024))
    assert instance_context(asked) == 1024


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
    spec = InstanceSpec(model=SMOL.name, nodes=["a", "b"], context=2048, speculate=False,
                        exact=True)  # fmt: skip
    # The pins go; what each request gets stays.
    assert spec.relaxed() == InstanceSpec(model=SMOL.name, context=2048, speculate=False,
                                          exact=True)  # fmt: skip
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


def _kv(f, tokens: int, layers: int) -> int:  # type: ignore[no-untyped-def]
    return f.kv_bytes_per_token_layer * Policy().kv_sequences * tokens * layers


def test_the_default_context_is_the_trained_one_where_memory_allows() -> None:
    spec = InstanceSpec(model=SMOL.name)
    roomy = {"a": node("a", "a", CPU, 48 * GiB)}
    stages = place(spec, SMOL, roomy)
    assert default_context(spec, SMOL, roomy, stages) == 8192
    got = placement(spec, SMOL, roomy, {})
    assert (got.stages, got.context) == (stages, 8192)
    # The KV of 8192 tokens (1.5 GB) may take at most half the plan's usable memory:
    # 2.5 GiB of it is not enough, so the context halves back to the base 4096.
    assert _kv(SMOL, 8192, 30) > (5 * GiB // 2) // 2 > _kv(SMOL, 4096, 30)
    tight = {"a": node("a", "a", CPU, 5 * GiB // 2 + Policy().floor_bytes)}
    assert placement(spec, SMOL, tight, {}).context == 4096
    # The user's context is kept as it is, the plan is the same either way.
    asked = InstanceSpec(model=SMOL.name, context=2048)
    assert placement(asked, SMOL, roomy, {}).context == 2048


def test_a_long_trained_context_halves_until_its_kv_fits_and_never_moves_a_stage() -> None:
    spec = InstanceSpec(model=BIG.name)
    nodes = {n.id: n for n in (node("a", "a", CPU, 80 * GiB), node("b", "b", CPU, 80 * GiB))}
    base = place(spec, BIG, nodes)
    got = placement(spec, BIG, nodes, {})
    assert got.stages == base  # the plan of the base context, unchanged
    # 80 layers of 4 KiB a token x 8 requests: 2.5 MiB a token. The weights take ~41 GiB
    # of the 79 usable, so 8192 tokens (20 GiB) fits and is under half; 16384 is not.
    assert got.context == 8192
    assert stage_need(BIG, 0, 80, "llama_cpp", context=16384) > 80 * GiB
    # Two smaller nodes: the split the base context needed takes what they have spare.
    small = {n.id: n for n in (node("a", "a", CPU, 40 * GiB), node("b", "b", CPU, 40 * GiB))}
    split = placement(spec, BIG, small, {})
    assert len(split.stages) == 2 and split.context == 8192
    assert stage_need(BIG, 0, 40, "llama_cpp", context=16384) > 40 * GiB
    big = {n.id: n for n in (node("a", "a", CPU, 400 * GiB),)}
    assert placement(spec, BIG, big, {}).context == 65536
    # Pure: the same inputs give the same context, whichever node computes it.
    assert placement(spec, BIG, dict(reversed(list(big.items()))), {}).context == 65536


def test_a_model_trained_for_less_than_the_base_gets_its_trained_context() -> None:
    short = msgspec.structs.replace(SMOL, n_ctx_train=2048)
    nodes = {"a": node("a", "a", CPU, 48 * GiB)}
    assert placement(InstanceSpec(model=SMOL.name), short, nodes, {}).context == 2048


def test_a_repair_chooses_the_context_again_with_its_survivors_credit() -> None:
    spec = InstanceSpec(model=SMOL.name, nodes=["a", "b"])
    nodes = {n.id: n for n in (node("a", "a", CPU, 8 * GiB), node("b", "b", CPU, 8 * GiB))}
    first = placement(spec, SMOL, nodes, {})
    assert len(first.stages) == 2 and first.context == 8192
    inst = Instance(id="i", spec=spec, stages=first.stages, facts=SMOL, context=first.context)
    # a runs its stage: its free memory no longer counts that stage, the credit does.
    held = stage_need(SMOL, 0, first.stages[0].end, "llama_cpp", context=8192)
    a = node("a", "a", CPU, 8 * GiB - held, mem_total=8 * GiB, holds=["i"])
    repaired = placement(spec.relaxed(), SMOL, {"a": a}, {}, previous=inst)
    assert [s.node for s in repaired.stages] == ["a"] and repaired.context == 8192


def test_seats_past_8_reserve_kv_for_each_and_a_repair_keeps_them() -> None:
    nodes = {n.id: n for n in (node("a", "a", CPU, 80 * GiB), node("b", "b", CPU, 80 * GiB))}
    ctx = {"context": 16384}
    assert len(place(InstanceSpec(model=BIG.name, seats=4, **ctx), BIG, nodes)) == 1
    # Each seat holds a whole context's KV: 16 of them need both nodes.
    assert len(place(InstanceSpec(model=BIG.name, seats=16, **ctx), BIG, nodes)) == 2
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model=BIG.name, seats=64, **ctx), BIG, nodes)
    assert "KV for 16384 tokens x 64 requests" in str(e.value)
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model=BIG.name, seats=65), BIG, nodes)
    assert e.value.reason == "bad_spec"
    assert InstanceSpec(model="m", nodes=["a"], seats=16).relaxed().seats == 16

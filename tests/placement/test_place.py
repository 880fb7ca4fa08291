"""Placement: deterministic, contiguous, within budgets, sticky on repair, typed errors.

The memory a stage needs is recomputed here from the rule as documented (``need``),
independently of ``meshd.placement``; so is the engine a node should pick.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from meshd.crdt.views import Health, Instance, InstanceSpec, NodeCard, RunnerStatus
from meshd.crdt.views import Stage as S
from meshd.domain.facts import ModelFacts
from meshd.domain.nodes import NodeResources
from meshd.placement import (
    PlacementError,
    Policy,
    fmt_bytes,
    next_generation,
    node_resources,
    place,
    plan_digest,
    predicted_tokens_s,
    repair_needed,
    stage_need,
)
from meshd.placement.place import SPLIT_GAIN

MiB = 1 << 20
GiB = 1 << 30
POLICY = Policy()
FLOOR = POLICY.floor_bytes

# --------------------------------------------------------------------------- models

# SmolLM2-135M-Instruct Q4_1: 30 blocks of ~3 MB, tied head, 3 KV heads x 64 dims (F16).
SMOL = ModelFacts(
    name="smollm2-135m",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    n_layers=30,
    hidden_size=576,
    n_ctx_train=8192,
    layer_bytes=[3_045_888] * 30,
    embed_bytes=15_925_248,
    head_bytes=0,
    kv_bytes_per_token_layer=2 * 3 * 64 * 2,
    quant_types=["F32", "Q4_1", "Q8_0"],
    engines=["llama_cpp", "mlx"],
)

# A 70B-like model at 4-bit: 80 blocks of ~500 MB, separate output head, GQA 8 x 128.
BIG = ModelFacts(
    name="llama-70b-q4",
    sha256="0" * 64,
    n_layers=80,
    hidden_size=8192,
    n_ctx_train=131072,
    layer_bytes=[500 * MiB + (i % 3) * MiB for i in range(80)],
    embed_bytes=525 * MiB,
    head_bytes=640 * MiB,
    kv_bytes_per_token_layer=2 * 8 * 128 * 2,
    quant_types=["F32", "Q4_0", "Q6_K"],
    engines=["llama_cpp", "mlx"],
)


def need(f: ModelFacts, start: int, end: int, engine: str, p: Policy = POLICY) -> int:
    """The documented memory rule, written out again."""
    last = end == f.n_layers
    carries_embed = engine != "mlx" or start == 0 or (last and f.head_bytes == 0)
    tokens = min(p.kv_tokens, f.n_ctx_train) if f.n_ctx_train else p.kv_tokens
    return (
        math.ceil(sum(f.layer_bytes[start:end]) * p.weight_overhead)
        + (f.embed_bytes if carries_embed else 0)
        + (f.head_bytes if last else 0)
        + (f.projector_bytes if start == 0 and engine != "mlx" else 0)
        + tokens * p.kv_sequences * f.kv_bytes_per_token_layer * (end - start)
        + p.floor_bytes
    )


def whole(f: ModelFacts) -> int:
    return need(f, 0, f.n_layers, "llama_cpp")


def expected_engine(backends: list[str], engines: list[str]) -> str | None:
    """MLX where it has a GPU, llama.cpp on the CPU, MLX on the CPU as a last resort."""
    have = set(backends)
    if "mlx" in engines and have & {"mlx-metal", "mlx-cuda"}:
        return "mlx"
    if "llama_cpp" in engines and any(b.startswith("llama_cpp-") for b in have):
        return "llama_cpp"
    if "mlx" in engines and "mlx-cpu" in have:
        return "mlx"
    return None


def node(nid: str, name: str, backends: list[str], avail: int, **kw) -> NodeResources:
    return NodeResources(id=nid, name=name, backends=backends, mem_available=avail, **kw)


def by_id(*rs: NodeResources) -> dict[str, NodeResources]:
    return {r.id: r for r in rs}


def instance(stages: list[S], spec: InstanceSpec, f: ModelFacts, gen: int = 1) -> Instance:
    return Instance(id="inst-1", spec=spec, stages=stages, generation=gen, facts=f)


def assert_valid_plan(
    stages: list[S],
    f: ModelFacts,
    nodes: dict[str, NodeResources],
    credit: dict[str, int] | None = None,
) -> None:
    """Contiguous cover, >= 1 layer a stage, distinct nodes, usable engine, within budget."""
    assert stages, "empty plan"
    pos = 0
    for s in stages:
        assert s.start == pos and s.end > s.start, stages
        pos = s.end
    assert pos == f.n_layers
    assert len({s.node for s in stages}) == len(stages)
    for s in stages:
        r = nodes[s.node]
        assert s.engine in f.engines
        assert any(b.split("-", 1)[0] == s.engine for b in r.backends), (s, r.backends)
        budget = r.mem_available + (credit or {}).get(s.node, 0)
        assert need(f, s.start, s.end, s.engine) <= budget, (s, budget)


# ------------------------------------------------------------------------ strategies

BACKENDS = ["mlx-metal", "mlx-cuda", "mlx-cpu", "llama_cpp-cpu", "llama_cpp-cuda", "onnx-cpu"]
# What real machines advertise: a Mac, a CUDA box, Linux CPU boxes, and odd ones out.
MACHINES = [
    ["llama_cpp-cpu", "mlx-metal"],
    ["mlx-metal"],
    ["llama_cpp-cpu", "llama_cpp-cuda", "mlx-cuda"],
    ["llama_cpp-cpu", "mlx-cpu"],
    ["llama_cpp-cpu"],
    ["mlx-cpu"],
    ["onnx-cpu"],
    [],
]
NAMES = ["studio", "mbp", "mini", "linux", "pi", "nuc", "laptop", "tower"]


@st.composite
def model_facts(draw: st.DrawFn) -> ModelFacts:
    family = draw(st.sampled_from(["smol", "big", "random"]))
    if family == "smol":
        base = SMOL
    elif family == "big":
        base = BIG
    else:
        n = draw(st.integers(1, 40))
        size = draw(st.integers(1 * MiB, 800 * MiB))
        jitter = draw(st.lists(st.integers(0, size // 4), min_size=n, max_size=n))
        base = ModelFacts(
            name="random",
            sha256="1" * 64,
            n_layers=n,
            hidden_size=1024,
            n_ctx_train=draw(st.sampled_from([0, 2048, 8192])),
            layer_bytes=[size + j for j in jitter],
            embed_bytes=draw(st.integers(0, 2 * size)),
            head_bytes=draw(st.sampled_from([0, size])),
            kv_bytes_per_token_layer=draw(st.sampled_from([0, 768, 4096])),
            engines=["llama_cpp", "mlx"],
        )
    engines = draw(st.sampled_from([["llama_cpp", "mlx"], ["llama_cpp"], ["mlx"]]))
    return replace(base, engines=engines)


@st.composite
def clusters(
    draw: st.DrawFn, f: ModelFacts, min_size: int = 1, max_size: int = 7, scale: float = 1.3
) -> dict[str, NodeResources]:
    """Nodes whose memory ranges from nothing to ``scale`` x the whole model's need."""
    count = draw(st.integers(min_size, max_size))
    names = draw(st.permutations(NAMES))[:count]
    ids = draw(
        st.lists(
            st.text("0123456789abcdef", min_size=8, max_size=8),
            min_size=count,
            max_size=count,
            unique=True,
        )
    )
    top = int(whole(f) * scale)
    out = {}
    for nid, name in zip(ids, names, strict=True):
        backends = draw(st.sampled_from(MACHINES))
        # Spread evenly over [0, top] (plain integers favour the small end).
        avail = draw(st.integers(0, 40)) * top // 40 + draw(st.integers(0, 1 << 20))
        tps = draw(st.sampled_from([0.0, 0.0, 5e9, 12.5e9, 40e9]))
        out[nid] = NodeResources(nid, name, backends, avail, mem_total=top * 2, decode_bps=tps)
    return out


@st.composite
def scenarios(draw: st.DrawFn, **kw) -> tuple[ModelFacts, dict[str, NodeResources]]:
    f = draw(model_facts())
    return f, draw(clusters(f, **kw))


def shuffled(draw: st.DrawFn, nodes: dict[str, NodeResources]) -> dict[str, NodeResources]:
    """The same nodes, inserted in another order, each listing its backends in another."""
    return {
        k: replace(nodes[k], backends=draw(st.permutations(nodes[k].backends)))
        for k in draw(st.permutations(list(nodes)))
    }


def outcome(spec: InstanceSpec, f: ModelFacts, nodes, previous=None):
    """The plan, or the error's (reason, shortfalls, message)."""
    try:
        return place(spec, f, nodes, previous)
    except PlacementError as e:
        return (e.reason, e.shortfalls, str(e))


def capable(f: ModelFacts, nodes: dict[str, NodeResources]) -> list[NodeResources]:
    """Nodes that can run the model, most usable memory first, ties on id."""
    ok = [r for r in nodes.values() if expected_engine(r.backends, f.engines)]
    return sorted(ok, key=lambda r: (-r.mem_available, r.id))


SPEC = InstanceSpec(model="m")
FAST = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------------- determinism


@FAST
@given(data=st.data(), min_nodes=st.integers(1, 3))
def test_plan_is_identical_whatever_the_order_of_the_nodes(data: st.DataObject, min_nodes: int):
    f, nodes = data.draw(scenarios())
    spec = InstanceSpec(model="m", min_nodes=min(min_nodes, f.n_layers))
    first = outcome(spec, f, nodes)
    again = outcome(spec, f, shuffled(data.draw, nodes))
    assert first == again
    if isinstance(first, list):
        gone = data.draw(st.sampled_from(sorted({s.node for s in first})))
        rest = {k: v for k, v in nodes.items() if k != gone}
        prev = instance(first, spec, f)
        assert outcome(spec, f, rest, prev) == outcome(spec, f, shuffled(data.draw, rest), prev)


# ------------------------------------------------------------------------ invariants


@FAST
@given(data=st.data(), min_nodes=st.integers(1, 4))
def test_plan_covers_every_layer_once_within_every_budget(data: st.DataObject, min_nodes: int):
    f, nodes = data.draw(scenarios())
    spec = InstanceSpec(model="m", min_nodes=min(min_nodes, f.n_layers))
    try:
        stages = place(spec, f, nodes)
    except PlacementError as e:
        assert e.reason in ("no_backend", "insufficient_memory", "no_nodes")
        return
    assert_valid_plan(stages, f, nodes)
    assert len(stages) >= spec.min_nodes


@FAST
@given(data=st.data())
def test_node_without_a_matching_backend_is_never_chosen(data: st.DataObject):
    f, nodes = data.draw(scenarios(scale=3.0))
    try:
        stages = place(SPEC, f, nodes)
    except PlacementError as e:
        if not capable(f, nodes):
            assert e.reason == "no_backend"
        return
    for s in stages:
        assert s.engine == expected_engine(nodes[s.node].backends, f.engines)


@FAST
@given(data=st.data())
def test_one_node_is_used_when_the_model_fits_on_one(data: st.DataObject):
    f, nodes = data.draw(scenarios(scale=3.0))
    ranked = capable(f, nodes)
    assume(ranked and whole(f) <= ranked[0].mem_available)
    best = ranked[0]
    engine = expected_engine(best.backends, f.engines)
    one = [S(node=best.id, start=0, end=f.n_layers, engine=engine)]
    got = place(SPEC, f, nodes)
    if got != one:
        # Only a split of measured nodes that predicts more speed replaces one node.
        assert all(r.decode_bps > 0 for r in ranked)
        pred = predicted_tokens_s(f, got, nodes.values())
        assert pred > predicted_tokens_s(f, one, nodes.values()) * SPLIT_GAIN * 0.999


@FAST
@given(data=st.data(), min_nodes=st.integers(2, 5))
def test_min_nodes_is_respected(data: st.DataObject, min_nodes: int):
    f, nodes = data.draw(scenarios(scale=3.0))
    spec = InstanceSpec(model="m", min_nodes=min_nodes)
    try:
        stages = place(spec, f, nodes)
    except PlacementError as e:
        if min_nodes > f.n_layers:
            assert e.reason == "bad_spec"
        elif len(nodes) < min_nodes:
            assert e.reason == "no_nodes"
        elif len(capable(f, nodes)) < min_nodes:
            assert e.reason == "no_backend"
        else:
            assert e.reason == "insufficient_memory"
        return
    assert len(stages) >= min_nodes
    assert_valid_plan(stages, f, nodes)


@FAST
@given(data=st.data())
def test_more_nodes_are_used_only_when_fewer_cannot_hold_the_model(data: st.DataObject):
    f, nodes = data.draw(scenarios(scale=1.0))
    try:
        stages = place(SPEC, f, nodes)
    except PlacementError:
        return
    ranked = capable(f, nodes)
    k = len(stages)
    # The k nodes used are the k with the most usable memory.
    assert {s.node for s in stages} == {r.id for r in ranked[:k]}
    if k > 1 and not all(r.decode_bps > 0 for r in ranked):
        # One node was not enough: even the biggest cannot take the whole model (with
        # every node measured, a faster split may be chosen: see test_measured.py).
        assert whole(f) > ranked[0].mem_available


# --------------------------------------------------------------------------- pinning


@FAST
@given(data=st.data())
def test_pinned_nodes_and_engines_are_respected(data: st.DataObject):
    f, nodes = data.draw(scenarios(scale=3.0))
    count = data.draw(st.integers(1, min(len(nodes), f.n_layers)))
    chosen = data.draw(st.permutations(sorted(nodes)))[:count]
    refs = [data.draw(st.sampled_from([nid, nodes[nid].name])) for nid in chosen]
    pins = [data.draw(st.sampled_from(["", *f.engines])) for _ in chosen]
    spec = InstanceSpec(model="m", nodes=refs, engines=pins)
    try:
        stages = place(spec, f, nodes)
    except PlacementError as e:
        lacking = [
            nid
            for nid, pin in zip(chosen, pins, strict=True)
            if not expected_engine(nodes[nid].backends, [pin] if pin else f.engines)
        ]
        assert e.reason == ("no_backend" if lacking else "insufficient_memory")
        return
    assert [s.node for s in stages] == chosen
    for s, pin in zip(stages, pins, strict=True):
        assert s.engine == (pin or expected_engine(nodes[s.node].backends, f.engines))
    assert_valid_plan(stages, f, nodes)


def test_unknown_pinned_node_is_a_typed_error():
    nodes = by_id(node("aa11bb22", "studio", ["mlx-metal"], 64 * GiB))
    with pytest.raises(PlacementError) as err:
        place(InstanceSpec(model="m", nodes=["studio", "garage-pi"]), SMOL, nodes)
    assert err.value.reason == "unknown_node"
    assert "garage-pi" in str(err.value)


def test_pinned_node_without_the_pinned_engine_is_refused():
    nodes = by_id(node("aa11bb22", "linux", ["llama_cpp-cpu"], 64 * GiB))
    spec = InstanceSpec(model="m", nodes=["linux"], engines=["mlx"])
    with pytest.raises(PlacementError) as err:
        place(spec, SMOL, nodes)
    assert err.value.reason == "no_backend"
    assert "linux" in str(err.value)


@pytest.mark.parametrize(
    ("spec", "facts"),
    [
        (InstanceSpec(model="m", min_nodes=0), SMOL),
        (InstanceSpec(model="m", min_nodes=31), SMOL),
        (InstanceSpec(model="m", nodes=["studio"], engines=["mlx", "mlx"]), SMOL),
        (InstanceSpec(model="m", engines=["mlx", "llama_cpp"]), SMOL),
        (InstanceSpec(model="m", engines=["onnx"]), SMOL),
        (InstanceSpec(model="m", nodes=["studio", "aa11bb22"]), SMOL),
        (
            SPEC,
            ModelFacts(
                name="m", sha256="", n_layers=3, hidden_size=1, n_ctx_train=0, layer_bytes=[1, 2]
            ),
        ),
    ],
    ids=[
        "min_nodes_0",
        "more_nodes_than_layers",
        "engines_not_parallel",
        "engines_without_nodes",
        "engine_model_cannot_use",
        "same_node_twice",
        "layer_sizes_mismatch",
    ],
)
def test_inconsistent_spec_is_bad_spec(spec: InstanceSpec, facts: ModelFacts):
    nodes = by_id(node("aa11bb22", "studio", ["mlx-metal", "llama_cpp-cpu"], 64 * GiB))
    with pytest.raises(PlacementError) as err:
        place(spec, facts, nodes)
    assert err.value.reason == "bad_spec"


# ---------------------------------------------------------------------------- repair


def footprint(f: ModelFacts, s: S) -> int:
    return need(f, s.start, s.end, s.engine) - FLOOR


@FAST
@given(data=st.data(), min_nodes=st.integers(1, 3))
def test_plan_whose_nodes_are_all_alive_is_returned_unchanged(data: st.DataObject, min_nodes):
    f, nodes = data.draw(scenarios())
    spec = InstanceSpec(model="m", min_nodes=min(min_nodes, f.n_layers))
    try:
        stages = place(spec, f, nodes)
    except PlacementError:
        return
    # A big node joins: the model does not move.
    joined = {**nodes, "ffffffff": node("ffffffff", "new", BACKENDS, 10 * whole(f))}
    again = place(spec, f, shuffled(data.draw, joined), instance(stages, spec, f))
    assert again == stages


@FAST
@given(data=st.data())
def test_loaded_plan_is_not_evicted_by_its_own_memory_use(data: st.DataObject):
    f, nodes = data.draw(scenarios())
    try:
        stages = place(SPEC, f, nodes)
    except PlacementError:
        return
    # Runners loaded: the heartbeats report that much less memory available.
    loaded = dict(nodes)
    for s in stages:
        r = nodes[s.node]
        loaded[s.node] = replace(
            r, mem_available=r.mem_available - footprint(f, s), holds=["inst-1"]
        )
    assert place(SPEC, f, loaded, instance(stages, SPEC, f)) == stages


@FAST
@given(data=st.data(), min_nodes=st.integers(1, 3))
def test_dead_stage_moves_whole_to_the_best_spare_and_nothing_else_moves(
    data: st.DataObject, min_nodes: int
):
    f, nodes = data.draw(scenarios(min_size=2))
    spec = InstanceSpec(model="m", min_nodes=min(min_nodes, f.n_layers))
    try:
        stages = place(spec, f, nodes)
    except PlacementError:
        return
    dead = data.draw(st.sampled_from(stages))
    rest = {k: v for k, v in nodes.items() if k != dead.node}
    in_plan = {s.node for s in stages}
    spares = [
        (r, e)
        for r in capable(f, rest)
        if r.id not in in_plan
        and need(f, dead.start, dead.end, e := expected_engine(r.backends, f.engines))
        <= r.mem_available
    ]
    assume(spares)
    # A plan of one stage that dies is made fresh: with every node measured, that may
    # be a faster split (test_a_measured_split_is_taken_only_when_it_is_faster).
    assume(len(stages) > 1 or not all(r.decode_bps > 0 for r in capable(f, rest)))
    spare, engine = spares[0]
    repaired = place(spec, f, rest, instance(stages, spec, f))
    assert repaired == [
        S(node=spare.id, start=s.start, end=s.end, engine=engine) if s == dead else s
        for s in stages
    ]


@FAST
@given(data=st.data(), min_nodes=st.integers(2, 4))
def test_without_a_spare_a_neighbour_takes_the_dead_stage(data: st.DataObject, min_nodes: int):
    f, nodes = data.draw(scenarios(min_size=2, scale=2.0))
    spec = InstanceSpec(model="m", min_nodes=min(min_nodes, f.n_layers))
    try:
        stages = place(spec, f, nodes)
    except PlacementError:
        return
    assume(len(stages) >= 2)
    i = data.draw(st.integers(0, len(stages) - 1))
    dead = stages[i]
    rest = {s.node: nodes[s.node] for s in stages if s is not dead}  # no spare left
    options = []  # (layers reloaded, order, plan)
    if i > 0:
        left = stages[i - 1]
        if need(f, left.start, dead.end, left.engine) <= rest[left.node].mem_available:
            grown = S(node=left.node, start=left.start, end=dead.end, engine=left.engine)
            options.append((dead.end - left.start, 0, [*stages[: i - 1], grown, *stages[i + 1 :]]))
    if i + 1 < len(stages):
        right = stages[i + 1]
        if need(f, dead.start, right.end, right.engine) <= rest[right.node].mem_available:
            grown = S(node=right.node, start=dead.start, end=right.end, engine=right.engine)
            options.append((right.end - dead.start, 1, [*stages[:i], grown, *stages[i + 2 :]]))
    relaxed = InstanceSpec(model="m")  # one node fewer than min_nodes may be all there is
    try:
        repaired = place(relaxed, f, rest, instance(stages, relaxed, f))
    except PlacementError as e:
        assert not options
        assert e.reason == "insufficient_memory"
        return
    if options:
        assert repaired == min(options, key=lambda o: o[:2])[2]
    else:
        assert_valid_plan(repaired, f, rest)


@FAST
@given(data=st.data(), min_nodes=st.integers(1, 3))
def test_repaired_plan_keeps_every_invariant(data: st.DataObject, min_nodes: int):
    f, nodes = data.draw(scenarios(min_size=2))
    spec = InstanceSpec(model="m", min_nodes=min(min_nodes, f.n_layers))
    try:
        stages = place(spec, f, nodes)
    except PlacementError:
        return
    # Some runners have loaded (their memory left mem_available), some not yet.
    now = dict(nodes)
    credit: dict[str, int] = {}
    for s in stages:
        if data.draw(st.booleans()):
            r = nodes[s.node]
            avail = r.mem_available - footprint(f, s)
            now[s.node] = replace(r, mem_available=avail, holds=["inst-1"])
            credit[s.node] = min(footprint(f, s), r.mem_total - avail)
    dead = data.draw(st.sampled_from(stages))
    del now[dead.node]
    try:
        repaired = place(spec, f, now, instance(stages, spec, f))
    except PlacementError as e:
        assert e.reason in ("insufficient_memory", "no_nodes", "no_backend")
        if e.reason == "insufficient_memory":
            assert e.shortfalls and all(v > 0 for v in e.shortfalls.values())
        return
    assert dead.node not in {s.node for s in repaired}
    assert len(repaired) >= spec.min_nodes
    assert_valid_plan(repaired, f, now, credit)


def test_stale_previous_plan_is_ignored():
    nodes = by_id(node("aa11bb22", "studio", ["mlx-metal"], 64 * GiB))
    broken = [S(node="aa11bb22", start=0, end=10, engine="mlx")]  # does not cover 30 layers
    assert place(SPEC, SMOL, nodes, instance(broken, SPEC, SMOL)) == place(SPEC, SMOL, nodes)


# ---------------------------------------------------------------------------- errors


@FAST
@given(f=model_facts(), frac=st.floats(0.0, 0.999), backend=st.sampled_from(BACKENDS[:5]))
def test_too_small_node_is_named_with_its_shortfall_in_bytes(f: ModelFacts, frac, backend):
    engine = expected_engine([backend], f.engines)
    assume(engine)
    avail = int(whole(f) * frac)
    assume(avail < whole(f))
    nodes = by_id(node("ab12cd34ef", "pi", [backend], avail))
    with pytest.raises(PlacementError) as err:
        place(SPEC, f, nodes)
    e = err.value
    short = need(f, 0, f.n_layers, engine) - avail
    assert e.reason == "insufficient_memory"
    assert e.shortfalls == {"ab12cd34ef": short}
    assert "'pi' (ab12cd34)" in e.message
    assert (f"layers 0-{f.n_layers - 1}" if f.n_layers > 1 else "layer 0") in e.message
    assert f"{fmt_bytes(short)} short" in e.message


@FAST
@given(data=st.data())
def test_cluster_too_small_names_each_node_short(data: st.DataObject):
    f = data.draw(model_facts())
    nodes = data.draw(clusters(f, scale=0.4))
    try:
        place(SPEC, f, nodes)
    except PlacementError as e:
        if e.reason != "insufficient_memory":
            return
        capable_ids = {r.id for r in capable(f, nodes)}
        assert e.shortfalls
        named = 0
        for nid, short in e.shortfalls.items():
            assert nid in capable_ids and short > 0
            if f"'{nodes[nid].name}' ({nid[:8]})" in e.message:
                named += 1
                assert f"{fmt_bytes(short)} short" in e.message
        # Up to six nodes are named; the rest are counted.
        assert named == min(6, len(e.shortfalls))
        if len(e.shortfalls) > 6:
            assert f"and {len(e.shortfalls) - 6} more node(s) short" in e.message


def test_no_live_node_is_no_nodes():
    with pytest.raises(PlacementError) as err:
        place(SPEC, SMOL, {})
    assert err.value.reason == "no_nodes"


def test_model_no_node_can_run_is_no_backend():
    q1_0 = replace(SMOL, engines=["llama_cpp"])  # e.g. a Q1_0 GGUF: MLX cannot read it
    nodes = by_id(node("aa11bb22", "studio", ["mlx-metal"], 64 * GiB))
    with pytest.raises(PlacementError) as err:
        place(SPEC, q1_0, nodes)
    assert err.value.reason == "no_backend"
    assert err.value.shortfalls == {}


# -------------------------------------------------------------------------- examples


def test_engine_is_mlx_on_a_gpu_mac_and_llama_cpp_on_a_cpu_box():
    nodes = by_id(
        node("aa000001", "studio", ["llama_cpp-cpu", "mlx-metal"], 4 * GiB),
        node("bb000002", "linux", ["mlx-cpu", "llama_cpp-cpu"], 4 * GiB),
    )
    stages = place(InstanceSpec(model="m", min_nodes=2), SMOL, nodes)
    assert {s.node: s.engine for s in stages} == {"aa000001": "mlx", "bb000002": "llama_cpp"}


def test_layers_split_in_proportion_to_usable_memory_and_speed():
    flat = ModelFacts(
        name="flat",
        sha256="",
        n_layers=40,
        hidden_size=1,
        n_ctx_train=0,
        layer_bytes=[100 * MiB] * 40,
        engines=["llama_cpp"],
    )
    big = node("aa000001", "big", ["llama_cpp-cpu"], FLOOR + 30 * GiB)
    small = node("bb000002", "small", ["llama_cpp-cpu"], FLOOR + 10 * GiB)
    spec = InstanceSpec(model="m", min_nodes=2)
    stages = place(spec, flat, by_id(small, big))
    assert [(s.node, s.end - s.start) for s in stages] == [("aa000001", 30), ("bb000002", 10)]
    # Measured speeds 1:3: the layers follow the speeds (memory only bounds them).
    slow, fast = replace(big, decode_bps=10e9), replace(small, decode_bps=30e9)
    stages = place(spec, flat, by_id(slow, fast))
    assert [(s.node, s.end - s.start) for s in stages] == [("aa000001", 10), ("bb000002", 30)]
    # ... within what each can hold: a fast node with room for 20 layers takes 20.
    tight = replace(small, mem_available=FLOOR + 20 * math.ceil(120 * MiB), decode_bps=30e9)
    stages = place(spec, flat, by_id(slow, tight))
    assert [(s.node, s.end - s.start) for s in stages] == [("aa000001", 20), ("bb000002", 20)]


def test_split_shifts_layers_off_a_node_that_would_exceed_its_budget():
    # Every llama.cpp stage carries the 1 GiB embedding: a 2:1 split by memory would put
    # 10 layers (1.17 GiB + 1 GiB) on a node with 2 GiB usable.
    f = ModelFacts(
        name="emb",
        sha256="",
        n_layers=30,
        hidden_size=1,
        n_ctx_train=0,
        layer_bytes=[100 * MiB] * 30,
        embed_bytes=GiB,
        engines=["llama_cpp"],
    )
    nodes = by_id(
        node("aa000001", "a", ["llama_cpp-cpu"], FLOOR + 4 * GiB),
        node("bb000002", "b", ["llama_cpp-cpu"], FLOOR + 2 * GiB),
    )
    stages = place(InstanceSpec(model="m", min_nodes=2), f, nodes)
    assert stages == [
        S(node="aa000001", start=0, end=22, engine="llama_cpp"),
        S(node="bb000002", start=22, end=30, engine="llama_cpp"),
    ]
    assert_valid_plan(stages, f, nodes)


def test_70b_spreads_over_the_macs_and_skips_the_pi():
    nodes = by_id(
        node("5a1d0001", "studio", ["mlx-metal", "llama_cpp-cpu"], 40 * GiB, mem_total=64 * GiB),
        node("3b9c0002", "mbp", ["mlx-metal"], 26 * GiB, mem_total=32 * GiB),
        node("c0de0003", "linux", ["llama_cpp-cpu", "mlx-cpu"], 24 * GiB, mem_total=32 * GiB),
        node("0e1f0004", "pi", ["llama_cpp-cpu"], 3 * GiB, mem_total=4 * GiB),
    )
    stages = place(SPEC, BIG, nodes)
    assert [s.node for s in stages] == ["5a1d0001", "3b9c0002"]
    assert [s.engine for s in stages] == ["mlx", "mlx"]
    assert_valid_plan(stages, BIG, nodes)
    # The mbp dies: the linux box (the best spare) takes exactly its layers.
    rest = {k: v for k, v in nodes.items() if k != "3b9c0002"}
    repaired = place(SPEC, BIG, rest, instance(stages, SPEC, BIG))
    assert repaired == [
        stages[0],
        S(node="c0de0003", start=stages[1].start, end=80, engine="llama_cpp"),
    ]


def test_smollm2_fits_on_a_single_small_node():
    nodes = by_id(
        node("0e1f0004", "pi", ["llama_cpp-cpu"], 2 * GiB),
        node("c0de0003", "linux", ["llama_cpp-cpu"], 2 * GiB),
    )
    # Equal memory: the tie breaks on node id.
    assert place(SPEC, SMOL, nodes) == [S(node="0e1f0004", start=0, end=30, engine="llama_cpp")]


@FAST
@given(f=model_facts(), data=st.data())
def test_stage_need_follows_the_documented_rule(f: ModelFacts, data: st.DataObject):
    start = data.draw(st.integers(0, f.n_layers - 1))
    end = data.draw(st.integers(start + 1, f.n_layers))
    engine = data.draw(st.sampled_from(["llama_cpp", "mlx"]))
    assert stage_need(f, start, end, engine) == need(f, start, end, engine)


# ------------------------------------------------------------------- helpers and views


def test_plan_digest_is_stable_and_tells_plans_apart():
    a = [S(node="n1", start=0, end=15, engine="mlx"), S(node="n2", start=15, end=30, engine="mlx")]
    b = [S(node="n1", start=0, end=16, engine="mlx"), S(node="n2", start=16, end=30, engine="mlx")]
    assert plan_digest(a) == plan_digest(list(a)) == "5308a740e0f16abe"
    assert plan_digest(a) != plan_digest(b)
    assert len(plan_digest(a)) == 16


def test_next_generation_counts_up_from_one():
    assert next_generation(None) == 1
    inst = instance([S(node="n1", start=0, end=30, engine="mlx")], SPEC, SMOL, gen=7)
    assert next_generation(inst) == 8


def test_repair_is_needed_only_when_a_stage_node_is_gone():
    stages = [
        S(node="n1", start=0, end=15, engine="mlx"),
        S(node="n2", start=15, end=30, engine="mlx"),
    ]
    inst = instance(stages, SPEC, SMOL)
    assert not repair_needed(inst, ["n1", "n2", "n3"])
    assert repair_needed(inst, ["n1", "n3"])
    assert repair_needed(instance([], SPEC, SMOL), ["n1"])


def card(nid: str, name: str, avail: int, backends: list[str]) -> NodeCard:
    return NodeCard(
        id=nid,
        name=name,
        incarnation="i",
        cluster="c",
        version="0",
        os="linux",
        arch="x86_64",
        cpu_count=4,
        mem_total=16 * GiB,
        mem_available=avail,
        backends=backends,
        mesh_port=1,
        pub_port=2,
        api_port=3,
    )


def test_node_resources_take_memory_from_the_heartbeat_and_skip_dead_nodes():
    cards = {
        "n1": card("n1", "studio", 8 * GiB, ["mlx-metal", "llama_cpp-cpu"]),
        "n2": card("n2", "linux", 6 * GiB, ["llama_cpp-cpu"]),
        "n3": card("n3", "pi", 1 * GiB, ["llama_cpp-cpu"]),
    }
    runner = RunnerStatus(instance="inst-1", generation=1, state="ready")
    healths = {
        "n1": Health(
            seq=3,
            mem_available=5 * GiB,
            decode_bps=2.0**33 * 1.01,
            runners=[runner],
            rtt_ms={"n2": 0.3, "n7": 4.0},
        ),
        "n2": Health(seq=1),  # reports no memory figure: the card's stands
    }
    res = node_resources(cards, healths, live=["n2", "n1", "n9"])
    assert list(res) == ["n1", "n2"]
    # The speed rounded down to a step, the round trips up to a power of two ms, and
    # only those to the nodes asked about.
    assert res["n1"] == NodeResources(
        "n1", "studio", ["llama_cpp-cpu", "mlx-metal"], 5 * GiB, 16 * GiB, 8.59e9,
        holds=["inst-1"], rtt_ms={"n2": 0.5},
    )  # fmt: skip
    assert res["n2"].mem_available == 6 * GiB and res["n2"].decode_bps == 0.0


# ------------------------------------------------------------- unsplittable models

GEMMA = msgspec.structs.replace(BIG, name="gemma3n-like", architecture="gemma3n")


def test_an_embedding_only_model_is_never_split_and_says_why() -> None:
    encoder = msgspec.structs.replace(BIG, name="bert-like", architecture="bert",
                                      embedding_only=True)  # fmt: skip
    half = whole(BIG) // 2 + 4 * GiB
    two = by_id(node("a", "a", ["llama_cpp-cpu"], half), node("b", "b", ["llama_cpp-cpu"], half))
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model="m", min_nodes=2), encoder, two)
    assert e.value.reason == "bad_spec" and "encoder" in e.value.message
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model="m"), encoder, two)
    assert e.value.reason == "insufficient_memory"
    big = by_id(node("a", "a", ["llama_cpp-cpu"], whole(BIG) + GiB))
    (stage,) = place(InstanceSpec(model="m"), encoder, big)
    assert (stage.start, stage.end) == (0, encoder.n_layers)


def test_a_model_whose_split_is_not_proven_is_never_split() -> None:
    from meshd.placement import SPLIT_PROVEN

    assert GEMMA.architecture not in SPLIT_PROVEN["gguf"]
    half = whole(BIG) // 2 + 4 * GiB
    two = by_id(node("a", "a", ["llama_cpp-cpu"], half), node("b", "b", ["llama_cpp-cpu"], half))
    # The llama twin of the same size is split over both ...
    assert len(place(InstanceSpec(model="m"), BIG, two)) == 2
    # ... the gemma3n one is not: a typed error that says why, nothing placed.
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model="m"), GEMMA, two)
    assert e.value.reason == "insufficient_memory" and "runs whole" in e.value.message
    assert "per-layer embeddings" in e.value.message
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model="m", min_nodes=2), GEMMA, two)
    assert e.value.reason == "bad_spec"
    with pytest.raises(PlacementError) as e:
        place(InstanceSpec(model="m", nodes=["a", "b"]), GEMMA, two)
    assert e.value.reason == "bad_spec"
    # One node that holds it: one stage.
    big = by_id(
        node("a", "a", ["llama_cpp-cpu"], whole(BIG) + GiB), node("b", "b", ["llama_cpp-cpu"], half)
    )
    (stage,) = place(InstanceSpec(model="m"), GEMMA, big)
    assert (stage.node, stage.start, stage.end) == ("a", 0, GEMMA.n_layers)
    # Its node dies: the repair moves it whole, or says it cannot.
    prev = instance([stage], InstanceSpec(model="m"), GEMMA)
    with pytest.raises(PlacementError):
        place(
            InstanceSpec(model="m"),
            GEMMA,
            by_id(big["b"], node("c", "c", ["llama_cpp-cpu"], half)),
            prev,
        )


def test_the_image_projector_is_counted_on_a_llama_cpp_stage_0() -> None:
    seen = msgspec.structs.replace(SMOL, projector_bytes=200 * 2**20)
    plain = {(s, e, eng): stage_need(SMOL, s, e, eng) for s, e in ((0, 15), (15, 30))
             for eng in ("llama_cpp", "mlx")}  # fmt: skip
    assert stage_need(seen, 0, 15, "llama_cpp") - plain[(0, 15, "llama_cpp")] == 200 * 2**20
    assert stage_need(seen, 15, 30, "llama_cpp") == plain[(15, 30, "llama_cpp")]
    # MLX runs no projector (an image request to it is refused, not run).
    assert stage_need(seen, 0, 15, "mlx") == plain[(0, 15, "mlx")]

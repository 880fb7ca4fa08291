"""The cluster queries on one snapshot, built from literals: no process, no socket.

What the request path, the repair loop and the API ask of the cluster (which instance
serves a model, what state each stage is in, what a repair writes, when waiting for one
is pointless, where a broken request may go next) is pure: these tests pin each answer.
"""

from __future__ import annotations

import pytest

from meshd.crdt.liveness import Liveness
from meshd.crdt.lww import LWWMap
from meshd.crdt.views import (
    Health,
    Instance,
    InstanceSpec,
    NodeCard,
    RunnerStatus,
    Stage,
    encode,
    health_key,
    instance_key,
    node_key,
)
from meshd.domain.facts import ModelFacts
from meshd.domain.nodes import Device
from meshd.engines.protocol import STAGE_FAULT
from meshd.node.cluster import CRASH_LOOP, MODEL_MISSING, ClusterView, gave_up
from meshd.node.errors import RequestFailed
from meshd.node.requests import replay_target

GiB = 1 << 30
FACTS = ModelFacts(
    name="m",
    sha256="ab" * 32,
    n_layers=8,
    hidden_size=64,
    n_ctx_train=2048,
    layer_bytes=[64 << 20] * 8,
    embed_bytes=8 << 20,
    head_bytes=8 << 20,
    kv_bytes_per_token_layer=256,
    quant_types=["F32"],
    engines=["llama_cpp"],
)


def card(nid: str, *, mem: int = 8 * GiB, models: tuple[str, ...] = ("m",), facts=()) -> NodeCard:
    return NodeCard(
        id=nid, name=f"n-{nid}", incarnation="i", cluster="c", version="0", os="linux",
        arch="x86_64", cpu_count=2, mem_total=mem, mem_available=mem,
        backends=["llama_cpp-cpu"], addresses=[f"10.0.0.{ord(nid[0])}"], mesh_port=1,
        pub_port=2, api_port=3, models=list(models), model_facts=list(facts),
    )  # fmt: skip


def runner(inst: str, stage: int, state: str = "ready", *, gen: int = 1, port: int = 5000,
           reason: str = "") -> RunnerStatus:  # fmt: skip
    return RunnerStatus(
        instance=inst, generation=gen, stage=stage, state=state, reason=reason, port=port
    )  # type: ignore[arg-type]


def health(*runners: RunnerStatus, state: str = "up") -> Health:
    return Health(seq=1, state=state, runners=list(runners))  # type: ignore[arg-type]


def inst(iid: str, *nodes: str, gen: int = 1, model: str = "m") -> Instance:
    n = len(nodes)
    bounds = [round(i * 8 / n) for i in range(n + 1)]
    stages = [
        Stage(node=nid, start=bounds[i], end=bounds[i + 1], engine="llama_cpp")
        for i, nid in enumerate(nodes)
    ]
    return Instance(id=iid, spec=InstanceSpec(model=model), stages=stages, generation=gen,
                    facts=FACTS)  # fmt: skip


def view(
    cards: list[NodeCard],
    healths: dict[str, Health],
    instances: list[Instance],
    liveness: dict[str, str] | None = None,
) -> ClusterView:
    live = {c.id: "alive" for c in cards} if liveness is None else {"a": "alive", **liveness}
    return ClusterView(
        self_id="a",
        cards={c.id: c for c in cards},
        healths=healths,
        instances={i.id: i for i in instances},
        liveness=live,  # type: ignore[arg-type]
        ages={n: 0.0 for n in live},
    )


# -- stage states ------------------------------------------------------------------------
def test_ready_stages_carry_the_runner_address_from_the_card() -> None:
    i = inst("x", "a", "b")
    v = view([card("a"), card("b")], {"a": health(runner("x", 0, port=7001)),
                                      "b": health(runner("x", 1, port=7002))}, [i])  # fmt: skip
    states = v.stage_states(i)
    assert [s.state for s in states] == ["ready", "ready"]
    assert states[1].addr is not None and states[1].addr.port == 7002
    assert states[1].addr.addresses == card("b").addresses
    assert v.is_ready(i)


def test_a_stage_on_a_node_that_is_not_live_is_unavailable() -> None:
    i = inst("x", "a", "b")
    v = view([card("a"), card("b")], {"a": health(runner("x", 0)), "b": health(runner("x", 1))},
             [i], liveness={"b": "dead"})  # fmt: skip
    states = v.stage_states(i)
    assert states[1].state == "unavailable" and states[1].addr is None
    assert not v.is_ready(i)


def test_a_ready_runner_of_an_older_generation_reads_as_loading() -> None:
    i = inst("x", "a", gen=2)
    v = view([card("a")], {"a": health(runner("x", 0, gen=1))}, [i])
    assert v.stage_states(i)[0].state == "loading"
    assert not v.is_ready(i)


def test_the_newest_runner_of_a_stage_wins_over_a_given_up_one_of_an_older_plan() -> None:
    i = inst("x", "a", gen=3)
    old = runner("x", 0, "failed", gen=1, reason=f"{CRASH_LOOP}: 4 exits")
    v = view([card("a")], {"a": health(old, runner("x", 0, gen=3))}, [i])
    assert v.stage_states(i)[0].state == "ready"


def test_find_instance_prefers_a_ready_instance_then_the_lowest_id() -> None:
    loading, ready = inst("a1", "a"), inst("b2", "b")
    v = view([card("a"), card("b")], {"a": health(runner("a1", 0, "loading")),
                                      "b": health(runner("b2", 0))}, [loading, ready])  # fmt: skip
    assert v.find_instance("m") == ready
    v2 = view([card("a"), card("b")], {}, [ready, loading])
    assert v2.find_instance("m") == loading  # none ready: by id
    assert v.find_instance("other") is None


# -- models ------------------------------------------------------------------------------
def test_known_models_are_those_placed_and_those_a_live_node_holds() -> None:
    v = view([card("a", models=("m",)), card("b", models=("q",))], {},
             [inst("x", "a", model="placed")], liveness={"b": "dead"})  # fmt: skip
    assert v.known_models() == ["m", "placed"]
    assert v.is_known("m") and not v.is_known("q")


def test_facts_come_from_a_live_holders_card_under_the_name_asked() -> None:
    v = view([card("a", models=()), card("b", facts=(FACTS,))], {}, [])
    got = v.facts_from_peers("m")
    assert got is not None and got.sha256 == FACTS.sha256
    dead = view([card("a", models=()), card("b", facts=(FACTS,))], {}, [],
                liveness={"b": "dead"})  # fmt: skip
    assert dead.facts_from_peers("m") is None


def test_placement_uses_serving_holders_only_and_any_node_for_a_path() -> None:
    v = view([card("a", models=()), card("b"), card("c"), card("d")],
             {"c": health(state="draining")}, [], liveness={"d": "dead", "b": "alive",
                                                          "c": "alive"})  # fmt: skip
    assert set(v.live_resources("m")) == {"b"}
    assert set(v.live_resources("/models/x.gguf")) == {"a", "b"}


def holder(nid: str, *, mem: int = 8 * GiB, port: int = 7000) -> NodeCard:
    """A node that holds ``m`` (with its facts) and serves its slices on ``port``."""
    import msgspec

    return msgspec.structs.replace(card(nid, mem=mem, facts=(FACTS,)), weights_port=port)


def test_weight_holders_are_live_nodes_advertising_the_same_file_with_a_weights_port() -> None:
    other = msgspec_replace(FACTS, sha256="cd" * 32)
    v = view(
        [card("a", models=()), holder("b"), holder("c"), holder("d", port=0),
         msgspec_replace(holder("e"), model_facts=[other]), holder("f")],
        {}, [], liveness={"b": "alive", "c": "alive", "d": "alive", "e": "alive", "f": "dead"},
    )  # fmt: skip
    assert [h.node for h in v.weight_holders("m", FACTS.sha256)] == ["b", "c"]
    assert v.weight_holders("m", FACTS.sha256)[0].port == 7000


def test_a_node_lacking_the_model_is_a_fetcher_only_while_a_holder_serves_slices() -> None:
    nodes = [card("a", models=()), holder("b"), card("c", models=())]
    v = view(nodes, {}, [])
    assert set(v.fetchers("m", FACTS)) == {"a", "c"}
    # No holder that serves slices (an old node, or none live): nobody fetches.
    old = view([card("a", models=()), card("b", facts=(FACTS,))], {}, [])
    assert old.fetchers("m", FACTS) == {}
    assert view(nodes, {}, [], liveness={"b": "dead", "c": "alive"}).fetchers("m", FACTS) == {}
    # An MLX folder's range is fetched only by a node that runs MLX.
    assert v.fetchers("m", msgspec_replace(FACTS, format="mlx")) == {}
    mlx = [card("a", models=()), holder("b"), msgspec_replace(card("c", models=()),
           backends=["mlx-cpu", "llama_cpp-cpu"])]  # fmt: skip
    assert set(view(mlx, {}, []).fetchers("m", msgspec_replace(FACTS, format="mlx"))) == {"c"}


def test_placement_prefers_holders_and_takes_a_fetcher_only_when_they_cannot_hold_it() -> None:
    fits = view([card("a", models=()), holder("b"), holder("c")], {}, [])
    stages, _, _ = fits.place_new(InstanceSpec(model="m"), FACTS)
    assert [s.node for s in stages] == ["b"]
    # 512 MiB usable beside the floor: less than the model needs (670 MiB), more than half.
    room = 1 * GiB
    # The holder is too small: the roomier fetcher takes the whole model (fewest nodes).
    big = view([card("a", models=(), mem=8 * GiB), holder("b", mem=room)], {}, [])
    stages, nodes, _ = big.place_new(InstanceSpec(model="m"), FACTS)
    assert [s.node for s in stages] == ["a"] and set(nodes) == {"a", "b"}
    # Neither holds it alone: split over the holder and the fetcher.
    both = view([card("a", models=(), mem=room), holder("b", mem=room)], {}, [])
    stages, _, _ = both.place_new(InstanceSpec(model="m"), FACTS)
    assert sorted(s.node for s in stages) == ["a", "b"]
    # Named: a node that lacks the file is used as asked.
    stages, _, _ = fits.place_new(InstanceSpec(model="m", nodes=["n-b", "n-a"]), FACTS)
    assert [s.node for s in stages] == ["b", "a"]


def msgspec_replace(obj, **changes):  # type: ignore[no-untyped-def]
    import msgspec

    return msgspec.structs.replace(obj, **changes)


# -- repairs -----------------------------------------------------------------------------
def test_a_repair_moves_only_the_lost_stage_with_the_next_generation() -> None:
    i = inst("x", "a", "b")
    v = view([card("a"), card("b"), card("c")], {"a": health(runner("x", 0))}, [i],
             liveness={"b": "dead", "c": "alive"})  # fmt: skip
    plans, failed = v.repairs()
    assert failed == {}
    (new,) = plans
    assert new.generation == 2 and new.id == "x"
    assert new.stages[0] == i.stages[0]  # the survivor stays where it is
    assert "b" not in {s.node for s in new.stages} and "c" in {s.node for s in new.stages}


def test_nothing_to_repair_when_every_stage_is_live() -> None:
    v = view([card("a"), card("b")], {}, [inst("x", "a", "b")])
    assert v.repairs() == ([], {})


def test_a_node_that_gave_up_its_runner_is_left_out_of_the_repair_for_good() -> None:
    i = inst("x", "a", "b")
    given_up = runner("x", 1, "failed", reason=f"{CRASH_LOOP}: 4 exits in 60 s")
    assert gave_up(given_up)
    v = view([card("a"), card("b"), card("c")], {"b": health(given_up)}, [i])
    (new,) = v.repairs()[0]
    assert "b" not in {s.node for s in new.stages}
    assert set(v.gave_up_on(i)) == {"b"}


def test_no_repair_is_possible_when_no_node_can_take_the_stage() -> None:
    i = inst("x", "a", "b")
    v = view([card("a", mem=GiB // 2), card("b")], {}, [i], liveness={"b": "dead"})
    plans, failed = v.repairs()
    assert plans == [] and "x" in failed
    why = v.unrepairable(i)
    assert why is not None and "node b lost" in why and "no repair possible" in why


def test_unrepairable_strict_counts_a_suspect_node_as_lost() -> None:
    i = inst("x", "a", "b")
    v = view([card("a", mem=GiB // 2), card("b")], {}, [i], liveness={"b": "suspect"})
    assert v.unrepairable(i) is None  # suspect is still live: wait
    assert v.unrepairable(i, strict=True) is not None  # a broken request: say so now


def test_a_missing_model_is_given_up_but_a_plain_failure_is_not() -> None:
    assert gave_up(runner("x", 0, "failed", reason=f"{MODEL_MISSING}: no file"))
    assert not gave_up(runner("x", 0, "failed", reason="OSError: disk full"))
    assert not gave_up(runner("x", 0, "loading", reason=f"{CRASH_LOOP}"))


def test_a_node_that_can_move_its_stages_is_relocatable() -> None:
    i = inst("x", "a")
    assert view([card("a"), card("b")], {}, [i]).relocatable(i, without="a")
    assert not view([card("a")], {}, [i]).relocatable(i, without="a")


# -- where a broken request goes -----------------------------------------------------------
CAUSE = RequestFailed("stage_lost", "stage on b went away")


def test_a_broken_request_is_replayed_on_the_repaired_plan_once_it_is_ready() -> None:
    old, new = inst("x", "a", "b"), inst("x", "a", "c", gen=2)
    v = view([card("a"), card("b"), card("c")],
             {"a": health(runner("x", 0, gen=2)), "c": health(runner("x", 1, gen=2))}, [new],
             liveness={"b": "dead", "c": "alive"})  # fmt: skip
    assert replay_target(v, old, CAUSE) == new


def test_a_request_a_stage_corrupted_waits_for_a_plan_without_that_node() -> None:
    # The fault's error arrives before the node's heartbeat gives the runner up: the
    # plan still looks ready, with the faulty node in it. Waiting, then the repair.
    fault = RequestFailed("stage_fault", "stage 1: 3 NaN in its output", node="b")
    old = inst("x", "a", "b")
    v = view([card("a"), card("b"), card("c")],
             {"a": health(runner("x", 0)), "b": health(runner("x", 1))}, [old])  # fmt: skip
    assert replay_target(v, old, CAUSE) == old and replay_target(v, old, fault) is None
    given_up = runner("x", 1, "failed", reason=f"{STAGE_FAULT}: 3 NaN in its output")
    assert gave_up(given_up)
    new = inst("x", "a", "c", gen=2)
    v = view([card("a"), card("b"), card("c")],
             {"a": health(runner("x", 0, gen=2)), "b": health(given_up),
              "c": health(runner("x", 1, gen=2))}, [new])  # fmt: skip
    assert replay_target(v, old, fault) == new


def test_a_broken_request_waits_while_the_repair_loads() -> None:
    old, new = inst("x", "a", "b"), inst("x", "a", "c", gen=2)
    v = view([card("a"), card("b"), card("c")],
             {"a": health(runner("x", 0, gen=2)), "c": health(runner("x", 1, "loading", gen=2))},
             [new], liveness={"b": "dead", "c": "alive"})  # fmt: skip
    assert replay_target(v, old, CAUSE) is None


@pytest.mark.parametrize(
    ("case", "code"),
    [("deleted", "instance_deleted"), ("no_repair", "stage_lost"),
     ("failed", "stage_failed"), ("stopping", "node_stopping")],
)  # fmt: skip
def test_a_broken_request_ends_at_once_when_waiting_cannot_help(case: str, code: str) -> None:
    old = inst("x", "a", "b")
    cards = [card("a", mem=GiB // 2), card("b")]
    if case == "deleted":
        v = view(cards, {}, [])
    elif case == "no_repair":
        v = view(cards, {}, [old], liveness={"b": "dead"})
    else:
        v = view(cards, {"b": health(runner("x", 1, "failed", reason="OSError"))}, [old])
    with pytest.raises(RequestFailed) as e:
        replay_target(v, old, CAUSE, aborted="stopping" if case == "stopping" else None)
    assert e.value.code == code


# -- built from the map ------------------------------------------------------------------
def test_a_view_of_the_map_reads_liveness_at_the_moment_it_is_taken() -> None:
    m = LWWMap()
    for nid in ("a", "b"):
        m.put(node_key(nid), encode(card(nid)), 1, nid)
        m.put(health_key(nid), encode(health()), 2, nid)
    m.put(instance_key("x"), encode(inst("x", "a", "b")), 3, "a")
    # A card written by another node than the one it names is no card at all.
    m.put(node_key("z"), encode(card("z")), 4, "a")
    live = Liveness(suspect_after=1.0, dead_after=2.0)
    live.beat("b", 1, now=10.0)
    early = ClusterView.build(m, "a", live, now=10.5)
    late = ClusterView.build(m, "a", live, now=12.5)
    assert set(early.cards) == {"a", "b"} and set(early.instances) == {"x"}
    assert early.liveness["a"] == "alive" and early.is_alive("b")
    assert late.liveness["b"] == "dead" and not late.is_live("b")
    assert late.ages["b"] == pytest.approx(2.5)


def test_gpu_memory_another_instance_takes_is_not_offered_to_the_next() -> None:
    from meshd.placement import node_vram, stage_offload

    gpu = Device(backend="llama_cpp-cuda", name="CUDA0", mem_total=2 * GiB, mem_free=2 * GiB)
    a = msgspec_replace(card("a", mem=1 * GiB), backends=["llama_cpp-cpu", "llama_cpp-cuda"],
                        devices=[gpu])  # fmt: skip
    alone = view([a], {}, [])
    free = alone.place_new(InstanceSpec(model="m"), FACTS).nodes["a"].devices[0].mem_free
    assert free == 2 * GiB
    # Instance x runs all 8 layers on a, offloaded as far as a's GPU took them.
    busy = view([a], {}, [inst("x", "a")])
    got = busy.place_new(InstanceSpec(model="m"), FACTS)
    probed = alone.place_new(InstanceSpec(model="m"), FACTS).nodes["a"]
    used = stage_offload(FACTS, 0, 8, "llama_cpp", node_vram(probed, "llama_cpp"), context=2048)[1]
    assert used > 0 and got.nodes["a"].devices[0].mem_free == 2 * GiB - used
    # A repair of x itself counts its own stages as its own, not as taken.
    repaired = busy._place(InstanceSpec(model="m"), FACTS, previous=busy.instances["x"])
    assert repaired.nodes["a"].devices[0].mem_free == 2 * GiB

"""Plans checked against the verifier's own view (pure, no socket): each node's figures
in a plan's basis are the ones that node signed, and a basis that leaves out a node that
was up and could serve the model is refused; an honest plan is taken, a node that joined
around the plan does not spoil it, and the owner's exclusions hold everywhere.

Every plan here is made the way a node makes one (``ClusterView.place_new`` and the
sources ``Instances`` attaches), at a fixed clock 10 s ago; the verifier holds newer
heartbeats, as a node checking it a moment later does."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from meshd.crdt.hlc import pack, wall_ms
from meshd.crdt.lww import Entry, LWWMap
from meshd.crdt.views import (
    Health,
    Instance,
    InstanceSpec,
    Member,
    NodeCard,
    PlanBasis,
    RunnerStatus,
    cards,
    encode,
    healths,
    instance_key,
    instances,
    member_key,
    members,
    node_key,
)
from meshd.crdt.views import health_key as hkey
from meshd.node.cluster import FETCH_FAILED, ClusterView
from meshd.node.config import NodeConfig
from meshd.node.instances import Instances, auto_instance_id
from meshd.node.plan_basis import BEAT_WINDOW_MS, signed_sources
from meshd.node.plans import left_out, plan_refusal, refuse_plan_entry
from meshd.node.requested import node_ids
from meshd.placement import PlacementError
from meshd.transport.identity import NodeKey, sign_entry

from .local import local_node
from .test_cluster_view import FACTS, GiB, card

NOW = wall_ms()
PLANNED = 10_000  # ms ago: when every plan here is made


def at(ms_ago: int) -> int:
    return pack(NOW - ms_ago, 0)


class Mesh:
    """Members by name, their cards (60 s old unless told) and heartbeats, in one map."""

    def __init__(self, **mem_gib: int) -> None:
        self.m = LWWMap()
        self.keys: dict[str, NodeKey] = {}
        for name, gib in mem_gib.items():
            self.join(name, gib)

    def id(self, name: str) -> str:
        return self.keys[name].node_id

    def put(self, name: str, key: str, value: msgspec.Struct, ms_ago: int) -> Entry:
        k = self.keys[name]
        e = sign_entry(k, Entry(key, at(ms_ago), k.node_id, encode(value)))
        self.m.merge(e)
        return e

    def join(
        self, name: str, gib: int, *, card_ago: int = 60_000, beat_ago: int = PLANNED + 500,
        **kw: object,
    ) -> None:  # fmt: skip
        k = self.keys[name] = NodeKey.generate()
        self.put(name, member_key(k.node_id),
                 Member(id=k.node_id, name=name, key=k.public, by=k.node_id), 70_000)  # fmt: skip
        c = msgspec.structs.replace(card(k.node_id, mem=gib * GiB, **kw), name=name)  # type: ignore[arg-type]
        self.put(name, node_key(k.node_id), c, card_ago)
        self.beat(name, beat_ago)

    def beat(self, name: str, ms_ago: int, *runners: RunnerStatus, state: str = "up") -> Entry:
        h = Health(seq=ms_ago, state=state, runners=list(runners))  # type: ignore[arg-type]
        return self.put(name, hkey(self.id(name)), h, ms_ago)

    def card(self, name: str, ms_ago: int, **changes: object) -> None:
        c = msgspec.convert(cards(self.m)[self.id(name)], NodeCard)
        self.put(name, node_key(self.id(name)), msgspec.structs.replace(c, **changes), ms_ago)

    def view(self, *live: str) -> ClusterView:
        """The cluster as a node saw it with only ``live`` up (all by default)."""
        ids = [self.id(n) for n in live] if live else list(cards(self.m))
        return ClusterView(
            self_id=ids[0], cards=cards(self.m), healths=healths(self.m),
            instances=instances(self.m), liveness=dict.fromkeys(ids, "alive"), ages={},
            members=members(self.m),
        )  # fmt: skip

    def plan(self, *live: str, spec: InstanceSpec | None = None, iid: str = "x") -> Instance:
        """A plan as ``Instances.place`` writes it, over the nodes ``live``."""
        spec = spec or InstanceSpec(model="m")
        stages, nodes, context = self.view(*live).place_new(spec, FACTS)
        basis = PlanBasis(spec=spec, nodes=list(nodes.values()))
        sources = signed_sources(self.m, basis.nodes)
        assert sources is not None
        return Instance(id=iid, spec=spec, stages=stages, facts=FACTS, context=context,
                        basis=msgspec.structs.replace(basis, sources=sources))  # fmt: skip

    def later(self, *silent: str) -> Mesh:
        """The state a moment after the plan: every node but ``silent`` has beaten."""
        for name in self.keys:
            if name not in silent:
                self.beat(name, 0)
        return self


def refusal(mesh: Mesh, inst: Instance, ms_ago: int = PLANNED) -> str | None:
    return plan_refusal(inst, mesh.m, at(ms_ago))


def test_an_honest_plan_is_taken_by_a_node_that_sees_it_a_moment_later() -> None:
    mesh = Mesh(a=16, b=8, c=4)
    inst = mesh.plan()
    split = mesh.plan(spec=InstanceSpec(model="m", min_nodes=2), iid="s")  # a 2-node split
    assert len(split.stages) == 2
    assert refusal(mesh, inst) is None and refusal(mesh, split) is None
    assert refusal(mesh.later(), inst) is None and refusal(mesh, split) is None
    # Through the trust rules' entry point, with the entry's own clock.
    e = sign_entry(mesh.keys["b"], Entry(instance_key("x"), at(PLANNED), mesh.id("b"),
                                         encode(inst)))  # fmt: skip
    assert refuse_plan_entry(e, mesh.m) is None


def test_a_basis_that_leaves_out_a_live_node_that_could_serve_is_refused() -> None:
    # Mallory makes a plan over herself alone: a (more memory) was up, and is still.
    mesh = Mesh(a=16, mallory=4)
    capture, fair = mesh.plan("mallory"), mesh.plan(iid="y")
    assert {s.node for s in capture.stages} == {mesh.id("mallory")}
    assert refusal(mesh, capture) == "partial_basis"  # by a node that gets it at once
    # Dated in the future, so that no node's heartbeat is recent: judged when they are.
    assert refusal(mesh, capture, -30_000) == "unverifiable_plan"
    mesh.later()
    assert refusal(mesh, capture) == "partial_basis"  # by one that gets it later
    assert left_out(capture, mesh.m, at(PLANNED)) == {mesh.id("a")}
    # Over every live node, the plan is a's: taken.
    assert refusal(mesh, fair) is None


def test_a_left_out_node_that_could_not_serve_or_would_change_nothing_is_no_fault() -> None:
    mesh = Mesh(a=16, b=4)
    mesh.join("c", 32, models=())  # holds no model, and no node offers its weights
    mesh.join("d", 2)  # holds it, but the plan would not use it
    mesh.join("gone", 64, beat_ago=PLANNED + 3_000)  # silent 3 s when the plan was made
    inst, without_a = mesh.plan("a", "b"), mesh.plan("b", "c", "d", iid="y")
    assert refusal(mesh, inst) is None
    mesh.later("gone")
    assert refusal(mesh, inst) is None
    assert refusal(mesh, without_a) == "partial_basis"
    # A node that gave up on the instance is left out by every writer.
    mesh.beat("a", 0, RunnerStatus(instance="y", generation=1, state="failed",
                                   reason=f"{FETCH_FAILED}: no holder"))  # fmt: skip
    assert refusal(mesh, without_a) is None
    # A draining node is not offered work either.
    mesh.beat("a", -1, state="draining")
    assert refusal(mesh, msgspec.structs.replace(without_a, id="z")) is None


def test_a_replica_that_avoided_the_nodes_of_another_is_taken() -> None:
    mesh = Mesh(a=16, b=8)
    mesh.put("a", instance_key("r1"), mesh.plan(iid="r1"), PLANNED + 200)  # on a
    r2 = mesh.plan(iid="r2")
    assert {s.node for s in r2.stages} == {mesh.id("b")}
    assert refusal(mesh.later(), r2) is None


@pytest.mark.parametrize("card_ago", [PLANNED - 2_000, PLANNED + 2_000])
def test_a_node_that_joined_around_the_plan_does_not_invalidate_it(card_ago: int) -> None:
    mesh = Mesh(b=8)
    inst = mesh.plan()
    mesh.join("late", 64, card_ago=card_ago)
    assert refusal(mesh.later(), inst) is None


def test_each_nodes_figures_must_be_the_ones_it_signed() -> None:
    mesh = Mesh(a=16, b=8)
    inst = mesh.plan()
    basis = inst.basis
    assert basis is not None
    i = next(j for j, n in enumerate(basis.nodes) if n.id == mesh.id("b"))

    def with_node(**changes: object) -> Instance:
        nodes = list(basis.nodes)
        nodes[i] = msgspec.structs.replace(nodes[i], **changes)
        return msgspec.structs.replace(inst, basis=msgspec.structs.replace(basis, nodes=nodes))

    def with_beat(e: Entry) -> Instance:
        sources = list(basis.sources)
        sources[i] = msgspec.structs.replace(sources[i], health=e)
        return msgspec.structs.replace(inst, basis=msgspec.structs.replace(basis, sources=sources))

    # b understated (so that it loses) or overstated (so that it wins).
    assert refusal(mesh, with_node(mem_available=0)) == "forged_basis"
    assert refusal(mesh, with_node(mem_available=1 << 40)) == "forged_basis"
    assert refusal(mesh, with_node(backends=[])) == "forged_basis"
    # A link b never measured (a fast one, so that a split over it wins).
    assert refusal(mesh, with_node(bw_mbps={mesh.id("a"): 1024.0})) == "forged_basis"
    # b's heartbeat re-signed by another member, or rewritten.
    h = basis.sources[i].health
    assert refusal(mesh, with_beat(sign_entry(mesh.keys["a"], h))) == "forged_basis"
    fat = encode(Health(seq=1, mem_available=1 << 40))
    assert refusal(mesh, with_beat(msgspec.structs.replace(h, value=fat))) == "forged_basis"
    # An old heartbeat of b (from when it had less free), or one from after the plan.
    old = mesh.beat("b", PLANNED + BEAT_WINDOW_MS + 1_000)
    assert refusal(mesh, with_beat(old)) == "stale_basis"
    assert refusal(mesh, with_beat(mesh.beat("b", 0))) == "stale_basis"
    # b restarted since on the same machine: the plan still holds; on another: out of date.
    mesh.card("b", 1_000, incarnation="j")
    assert refusal(mesh, inst) is None
    mesh.card("b", 500, backends=["llama_cpp-cpu", "llama_cpp-vulkan"])
    assert refusal(mesh, inst) == "stale_basis"
    # A card newer than this node holds: asked again when it comes.
    newer = msgspec.structs.replace(basis.sources[i], card=at(0) + 1)
    sources = list(basis.sources)
    sources[i] = newer
    ahead = msgspec.structs.replace(inst, basis=msgspec.structs.replace(basis, sources=sources))
    assert refusal(mesh, ahead) == "unverifiable_plan"
    # No sources at all: nothing signed to check.
    bare = msgspec.structs.replace(inst, basis=msgspec.structs.replace(basis, sources=[]))
    assert refusal(mesh, bare) == "unverifiable_plan"


def test_a_plan_refused_in_a_race_is_placed_again_with_the_node_it_missed() -> None:
    # b placed while a was away (a network blip: same card), then a came back.
    mesh = Mesh(b=8)
    mesh.join("a", 16, beat_ago=PLANNED + 3_000)  # silent for 3 s
    missed = mesh.plan("b")
    assert refusal(mesh, missed) is None  # taken by the nodes that saw a silent too
    mesh.later()
    assert refusal(mesh, missed) == "partial_basis"  # not by a, back
    # What a node that took it does once it sees a too (``Instances._complete``): the
    # next generation over the nodes seen now, sticky to the stages that serve.
    again = mesh.view().replan(missed)
    basis = again.basis
    assert basis is not None
    again = msgspec.structs.replace(
        again, basis=msgspec.structs.replace(basis, sources=signed_sources(mesh.m, basis.nodes))
    )
    assert again.stages == missed.stages and again.generation == 2
    assert mesh.id("a") in {n.id for n in basis.nodes}
    assert plan_refusal(again, mesh.m, at(0) + 1) is None


def test_the_owner_keeps_a_model_off_a_node_on_every_node() -> None:
    mesh = Mesh(a=16, b=8)
    a = mesh.id("a")
    spec = InstanceSpec(model="m", exclude=[a])
    inst = mesh.plan(spec=spec)
    mesh.later()
    assert a not in {s.node for s in inst.stages}
    assert refusal(mesh, inst) is None  # a, left out as the owner asked, is no fault
    # A plan that puts a stage there anyway is not placement's.
    assert inst.basis is not None
    onto = [msgspec.structs.replace(s, node=a) for s in inst.stages]
    assert refusal(mesh, msgspec.structs.replace(inst, stages=onto)) == "unreproducible_plan"
    # A repair keeps the exclusion.
    assert spec.relaxed().exclude == [a]
    assert a not in {s.node for s in mesh.view().replan(inst).stages}
    # Named by its name, kept as its id (a rename does not get it back).
    assert node_ids(mesh.view(), ["a"]) == [a]
    with pytest.raises(PlacementError, match="no node has it"):
        node_ids(mesh.view(), ["nobody"])


async def test_a_node_that_took_a_plan_missing_a_node_places_it_again_once_it_sees_it(
    tmp_path: Path,
) -> None:
    """``Instances.repair`` on one node's real state: b took the plan it made while a was
    silent; a is back, so b writes the next generation, with a in its basis."""
    mesh = Mesh(b=8)
    mesh.join("a", 16, beat_ago=PLANNED + 3_000)
    missed = mesh.plan("b")
    async with local_node(mesh.id("b")) as n:
        n.state.replica.install([*mesh.later().m.entries(), sign_entry(
            mesh.keys["b"], Entry(instance_key("x"), at(PLANNED), mesh.id("b"), encode(missed))
        )])  # fmt: skip
        instances = Instances(n.state, NodeConfig(), cache_dir=tmp_path, aborted=lambda: None)
        assert instances.repair() == []  # a not heard from here yet: nothing better to do
        n.state.liveness.beat(mesh.id("a"), 1, time.monotonic())
        (again,) = instances.repair()
        assert again.generation == 2 and again.stages == missed.stages
        assert again.basis is not None and mesh.id("a") in {x.id for x in again.basis.nodes}
        # Taken by a now (the clock of this test's state: set when the module loaded).
        assert plan_refusal(again, mesh.m, at(0) + 1) is None
        assert instances.repair() == []  # once


async def test_a_placement_moves_the_model_and_bounds_its_replicas(tmp_path: Path) -> None:
    """``Instances.place_requested`` on one node's real state: a placement takes the
    automatic instance's place (unless kept), and replicas never share a node."""
    mesh = Mesh(a=16, b=16, c=16)
    auto = mesh.plan("a", spec=InstanceSpec(model="m", nodes=[mesh.id("a")]),
                     iid=auto_instance_id("m"))  # fmt: skip
    # Liveness that outlasts a slow machine: every node stays alive through the test.
    async with local_node(mesh.id("b"), suspect_after=60, dead_after=120) as n:
        n.state.replica.install([*mesh.later().m.entries(), sign_entry(
            mesh.keys["a"], Entry(instance_key(auto.id), at(PLANNED), mesh.id("a"), encode(auto))
        )])  # fmt: skip
        for name in mesh.keys:
            n.state.liveness.beat(mesh.id(name), 1, time.monotonic())
        instances = Instances(n.state, NodeConfig(), cache_dir=tmp_path, aborted=lambda: None)
        instances._facts["m"] = FACTS  # the model's facts, as read from its file

        def placed() -> dict[str, list[str]]:
            return {i.id: [s.node for s in i.stages] for i in n.state.view().instances.values()}

        # Three nodes hold three replicas at most: five are refused, none placed.
        with pytest.raises(PlacementError, match="only 3 of the 5 replicas of m fit") as e:
            await instances.place_requested(InstanceSpec(model="m"), replicas=5)
        assert e.value.reason == "too_many_replicas" and "--replicas 3" in str(e.value)
        assert list(placed()) == [auto.id]
        # Kept: the split goes beside the automatic instance.
        (kept,) = await instances.place_requested(
            InstanceSpec(model="m", nodes=["b", "c"]), keep=True
        )
        assert placed() == {auto.id: [mesh.id("a")], kept.id: [mesh.id("b"), mesh.id("c")]}
        assert instances.remove(kept.id)
        # Not kept: the split over a and b takes its place.
        (split,) = await instances.place_requested(InstanceSpec(model="m", nodes=["a", "b"]))
        assert placed() == {split.id: [mesh.id("a"), mesh.id("b")]}
        # Replicas, each on a node of its own.
        pair = await instances.place_requested(InstanceSpec(model="m", min_nodes=1), replicas=2)
        nodes = [s.node for r in pair for s in r.stages]
        assert len(pair) == 2 and len(nodes) == len(set(nodes))

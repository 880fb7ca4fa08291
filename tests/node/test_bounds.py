"""Bounds on what members write: a large legitimate state still syncs (in pages), an
absurd key is refused without blocking anything after it, and a plan that placement
would not make is refused by every node."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest

from meshd.crdt.hlc import physical, wall_ms
from meshd.crdt.views import (
    Health,
    Instance,
    InstanceSpec,
    NodeCard,
    NodeSource,
    PlanBasis,
    Stage,
    health_key,
    instance_key,
    node_key,
)
from meshd.domain.facts import ModelFacts
from meshd.models import DEFAULT_MODEL
from meshd.node.plans import JOIN_MARGIN_MS
from meshd.placement import default_context, node_resources, place
from meshd.transport import wire
from tests.cluster import Cluster, wait_for

from .hand import HandMember

pytestmark = pytest.mark.timeout(240)


def _dropped(n, reason: str) -> int:
    return n.get("/healthz")["dropped"].get("entries", {}).get(reason, 0)


def _big_card(m: HandMember, kib: int) -> NodeCard:
    """A card as large as a member with many models may write (under its cap)."""
    facts = [
        ModelFacts(name=f"model-{i}", sha256=f"{i:064x}", n_layers=800, hidden_size=4096,
                   n_ctx_train=8192, layer_bytes=[123_456_789] * 800)
        for i in range(kib // 8)
    ]  # fmt: skip
    return NodeCard(
        id=m.key.node_id, name=f"big-{m.key.node_id[:4]}", incarnation="i", cluster="c",
        version="0", os="linux", arch="x86_64", cpu_count=1, mem_total=1, mem_available=1,
        addresses=["127.0.0.1"], mesh_port=1, pub_port=1, api_port=1, model_facts=facts,
    )  # fmt: skip


def test_six_megabytes_of_legitimate_state_sync_to_a_new_node(cluster: Cluster) -> None:
    a = cluster.start("a", extra_args=["--forget-after", "3600"])
    members = []
    try:
        size = 0
        while size < 6 * 1024 * 1024:
            m = HandMember(cluster.secret_file, a)
            members.append(m)
            card = m.forge(node_key(m.key.node_id), _big_card(m, 112), writer=m.key.node_id)
            size += len(card.value or b"")
            assert m.hello([card]) is not None
        wait_for(lambda: a.get("/healthz")["entries"] >= 2 * len(members), 30)
        t0 = time.monotonic()
        b = cluster.start("b", peers=[a], extra_args=["--forget-after", "3600"])

        def same() -> bool:
            ha, hb = a.get("/healthz"), b.get("/healthz")
            return ha["digest"] == hb["digest"] and ha["entries"] == hb["entries"]

        wait_for(same, 60, interval=0.2)
        synced_s = time.monotonic() - t0
        print(f"\n{size / 2**20:.1f} MiB of cards from {len(members)} members synced to a "
              f"new node in {synced_s:.1f} s")  # fmt: skip
        assert _dropped(b, "oversized") == 0
    finally:
        for m in members:
            m.close()


def test_an_absurd_instance_id_is_refused_and_later_instances_still_start(
    cluster: Cluster,
) -> None:
    a = cluster.start("a")
    m = HandMember(cluster.secret_file, a)
    try:
        spec = InstanceSpec(model=DEFAULT_MODEL)
        huge = "x" * (200 * 1024)
        inst = Instance(id=huge, spec=spec, stages=[])
        assert m.hello([m.forge(instance_key(huge), inst, writer=m.key.node_id)]) is not None
        wait_for(lambda: _dropped(a, "bad_key") >= 1, 5)
        r = httpx.post(a.api + "/v1/instances", json={"model": DEFAULT_MODEL}, timeout=120)
        assert r.status_code == 201, r.text
        iid = r.json()["id"]
        wait_for(lambda: all(s["state"] == "ready"
                             for s in a.get(f"/v1/instances/{iid}")["stages"]), 60)  # fmt: skip
    finally:
        m.close()


def test_a_plan_placement_would_not_make_is_refused_by_every_node(cluster: Cluster) -> None:
    """The insider's prompt capture, for real: a member (made here with the cluster's
    secret) writes a plan over a basis of itself alone, then one that blows up another
    node's figures; both stock nodes refuse both, and run nothing of them."""
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    m = HandMember(cluster.secret_file, a)
    mid = m.key.node_id
    try:
        # Real facts of the default model, from a placement a made, b kept off by name.
        r = httpx.post(a.api + "/v1/instances", json={"model": DEFAULT_MODEL, "exclude": ["b"]},
                       timeout=120)  # fmt: skip
        good = msgspec.convert(r.json(), dict)
        assert {s["node"] for s in good["stages"]} == {a.node_id}
        assert [(x["node"], x["reason"]) for x in good["excluded"]] == [
            (b.node_id, "excluded by the owner")
        ]
        inst = next(i for i in a.cluster()["instances"] if i["id"] == good["id"])
        facts = msgspec.convert(inst["facts"], ModelFacts)
        spec = InstanceSpec(model=DEFAULT_MODEL)
        # a's honest plan: b took it, with no doubt about it, exclusion and all.
        wait_for(lambda: good["id"] in {i["id"] for i in b.cluster()["instances"]}, 10)
        assert b.get(f"/v1/instances/{good['id']}")["excluded"] == good["excluded"]
        honest = ("partial_basis", "forged_basis", "stale_basis", "unverifiable_plan")
        assert not any(_dropped(n, why) for n in (a, b) for why in honest)
        # a's and b's cards and heartbeats as they signed them (a's Welcome), old enough
        # that a plan now must count them.
        welcome = m.hello([])
        assert isinstance(welcome, wire.Welcome)
        held = {e.key: e for e in welcome.entries}
        cards = [held[node_key(n.node_id)] for n in (a, b)]
        margin = JOIN_MARGIN_MS + 500
        wait_for(lambda: wall_ms() - max(physical(e.hlc) for e in cards) > margin, 20)
        # Mallory: a modest machine holding the model, placing it on herself alone.
        card = msgspec.structs.replace(
            _big_card(m, 0), name="mallory", mem_total=3 << 30, mem_available=3 << 30,
            backends=["llama_cpp-cpu"], models=[DEFAULT_MODEL],
        )  # fmt: skip
        beat = Health(seq=1, mem_available=3 << 30)
        own = [m.forge(node_key(mid), card, writer=mid), m.forge(health_key(mid), beat, writer=mid)]
        res = node_resources({mid: card}, {mid: beat}, [mid])
        stages = place(spec, facts, res)
        assert {s.node for s in stages} == {mid}
        capture = Instance(
            id="capture", spec=spec, stages=stages, facts=facts,
            context=default_context(spec, facts, res, stages),
            basis=PlanBasis(spec=spec, nodes=[res[mid]],
                            sources=[NodeSource(card=own[0].hlc, health=own[1])]),
        )  # fmt: skip
        # Every layer on b, "computed" from b's own signed heartbeat and a petabyte.
        rich = msgspec.structs.replace(
            node_resources(
                {b.node_id: msgspec.msgpack.decode(cards[1].value or b"", type=NodeCard)},
                {}, [b.node_id],
            )[b.node_id],
            mem_available=1 << 50,
        )  # fmt: skip
        on_b = [Stage(node=b.node_id, start=0, end=facts.n_layers, engine="llama_cpp")]
        src = NodeSource(card=cards[1].hlc, health=held[health_key(b.node_id)])
        forged = [
            capture,
            Instance(id="forged1", spec=spec, stages=on_b, facts=facts,
                     basis=PlanBasis(spec=spec, nodes=[rich], sources=[src])),
            Instance(id="forged2", spec=spec, stages=on_b, facts=facts),  # no basis
        ]  # fmt: skip
        entries = own + [m.forge(instance_key(i.id), i, writer=mid) for i in forged]
        for node in (a, b):
            m.node = node
            assert m.hello(entries) is not None
        for node in (a, b):
            wait_for(lambda n=node: all(_dropped(n, why) >= 1 for why in (
                "partial_basis", "forged_basis", "unverifiable_plan")), 10)  # fmt: skip
        forged_ids = {i.id for i in forged}
        for node in (a, b):
            assert not {i["id"] for i in node.cluster()["instances"]} & forged_ids
            health = next(n["health"] for n in node.cluster()["nodes"] if n["id"] == node.node_id)
            assert not any(r["instance"] in forged_ids for r in health.get("runners", []))
    finally:
        m.close()

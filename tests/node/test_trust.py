"""What a secured replica takes from the network, entry by entry (pure, no socket):
signatures bound to members' keys, member entries bound to their ids, bounded keys and
values, and plans that placement itself would make."""

from __future__ import annotations

import secrets

import msgspec
import pytest

from meshd.crdt.hlc import HLC
from meshd.crdt.lww import Entry
from meshd.crdt.replica import Replica
from meshd.crdt.views import (
    Health,
    Instance,
    InstanceSpec,
    Member,
    PlanBasis,
    encode,
    health_key,
    instance_key,
    member_key,
    node_key,
)
from meshd.domain.nodes import NodeResources
from meshd.node.trust import MAX_INSTANCES_PER_WRITER, ClusterTrust
from meshd.placement import place
from meshd.transport.identity import NodeKey, member_proof, sign_entry

from .test_cluster_view import FACTS, card

CLUSTER_KEY = secrets.token_bytes(32)


def member_entry(who: NodeKey, by: NodeKey, *, proof: bool = False, owner: bool = False) -> Entry:
    m = Member(id=who.node_id, name=who.node_id[:4], key=who.public, by=by.node_id,
               proof=member_proof(CLUSTER_KEY, who.public) if proof else b"",
               owner=owner)  # fmt: skip
    e = Entry(member_key(who.node_id), HLC().now(), by.node_id, encode(m))
    return sign_entry(by, e)


def replica_of(key: NodeKey, *, self_vouch: bool = True, plans: bool = True) -> Replica:
    """A member's replica. ``self_vouch``: a secret-file cluster, where its own member
    entry is vouched for with the cluster key; else it is the first node, an owner. The
    plans it takes are checked unless ``plans`` is False (see tests/node/test_plans.py)."""
    trust = ClusterTrust(CLUSTER_KEY, plans=_plans if plans else None, self_vouch=self_vouch)
    r = Replica(key.node_id, HLC(), signer=lambda e: sign_entry(key, e), trust=trust)
    r.install([member_entry(key, key, proof=self_vouch, owner=not self_vouch)])
    return r


def _plans(e: Entry, m) -> str | None:
    from meshd.node.plans import refuse_plan_entry

    return refuse_plan_entry(e, m)


def written(
    by: NodeKey, key: str, value: msgspec.Struct | None, writer: str | None = None
) -> Entry:
    e = Entry(key, HLC().now(), writer or by.node_id, None if value is None else encode(value))
    return sign_entry(by, e)


def refused(r: Replica, *entries: Entry) -> dict[str, int]:
    return r.merge_remote(list(entries)).refused


def test_a_members_signed_entries_are_taken() -> None:
    a, b = NodeKey.generate(), NodeKey.generate()
    r = replica_of(a)
    assert refused(r, member_entry(b, b, proof=True)) == {}
    assert refused(r, written(b, node_key(b.node_id), card(b.node_id)),
                   written(b, health_key(b.node_id), Health(seq=1))) == {}  # fmt: skip
    assert r.map.value(node_key(b.node_id)) is not None


def test_a_forged_writer_or_signature_is_refused() -> None:
    a, b, eve = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    r = replica_of(a)
    r.merge_remote([member_entry(b, b, proof=True)])
    # b's heartbeat, "stopped", written by another member's key: the signature fails.
    forged = written(a, health_key(b.node_id), Health(seq=9, state="stopped"), writer=b.node_id)
    assert refused(r, forged) == {"bad_signature": 1}
    # A key that is no member's: refused whatever it claims.
    assert refused(r, written(eve, node_key(eve.node_id), card(eve.node_id))) == {"not_member": 1}
    # Tampered value under a valid signature.
    good = written(b, health_key(b.node_id), Health(seq=1))
    bad = msgspec.structs.replace(good, value=encode(Health(seq=1, state="stopped")))
    assert refused(r, bad) == {"bad_signature": 1}


def test_member_entries_are_bound_to_their_ids_and_approvers() -> None:
    a, b, c, eve = (NodeKey.generate() for _ in range(4))
    r = replica_of(a)
    r.merge_remote([member_entry(c, c, proof=True)])
    # A member may approve a new key; a stranger may not approve itself without proof.
    assert refused(r, member_entry(eve, eve)) == {"not_member": 1}
    assert refused(r, member_entry(b, c)) == {}
    # Nobody binds another key to an existing id.
    m = Member(id=b.node_id, name="b", key=eve.public, by=c.node_id)
    assert refused(r, written(c, member_key(b.node_id), m)) == {"bad_member": 1}
    # A proof made with another cluster's key is no proof.
    m = Member(id=eve.node_id, name="e", key=eve.public, by=eve.node_id,
               proof=member_proof(secrets.token_bytes(32), eve.public))  # fmt: skip
    assert refused(r, written(eve, member_key(eve.node_id), m)) == {"bad_member": 1}


def test_a_kept_cluster_key_mints_no_member_outside_a_secret_file_cluster() -> None:
    owner, eve = NodeKey.generate(), NodeKey.generate()
    r = watching(owner)
    # The attack of issue 31: an identity minted with a kept cluster key.
    assert refused(r, member_entry(eve, eve, proof=True)) == {"not_member": 1}
    assert r.map.value(member_key(eve.node_id)) is None


def watching(owner: NodeKey, *, self_vouch: bool = False) -> Replica:
    """The replica of a member that the first node, ``owner``, approved."""
    v = NodeKey.generate()
    trust = ClusterTrust(CLUSTER_KEY, self_vouch=self_vouch)
    r = Replica(v.node_id, HLC(), signer=lambda e: sign_entry(v, e), trust=trust)
    r.install([member_entry(owner, owner, owner=True), member_entry(v, owner)])
    return r


def test_only_an_owner_removes_and_a_removal_is_for_good() -> None:
    owner, b, c = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    r = watching(owner)
    approval_b, approval_c = member_entry(b, owner), member_entry(c, owner)
    assert refused(r, approval_b, approval_c) == {}
    # A member that is no owner removes no one else, and makes no owner...
    assert refused(r, written(b, member_key(c.node_id), None)) == {"not_owner": 1}
    promoted = Member(id=b.node_id, name="b", key=b.public, by=b.node_id, owner=True)
    assert refused(r, written(b, member_key(b.node_id), promoted)) == {"not_owner": 1}
    # ...but approves a newcomer, and may leave.
    d = NodeKey.generate()
    assert refused(r, member_entry(d, b)) == {}
    assert refused(r, written(d, member_key(d.node_id), None)) == {}
    # The owner removes c: its old approval, replayed, loses to the tombstone, which is
    # never collected (so a replay after collection loses too), and c cannot vouch for
    # itself past it even where self-vouching exists.
    assert refused(r, written(owner, member_key(c.node_id), None)) == {}
    r.map.collect(HLC().now() + (1 << 40), [owner.node_id], keep=("member/",))
    assert r.map.get(member_key(c.node_id)) is not None
    r.merge_remote([approval_c])
    assert r.map.value(member_key(c.node_id)) is None
    vouching = watching(owner, self_vouch=True)
    vouching.merge_remote([member_entry(c, owner), written(owner, member_key(c.node_id), None)])
    assert refused(vouching, member_entry(c, c, proof=True)) == {"revoked": 1}
    # A member re-approving c is not enough; an owner is.
    assert refused(r, member_entry(c, b)) == {"not_owner": 1}
    assert refused(r, member_entry(c, owner)) == {}


def test_a_cluster_from_before_owners_takes_every_member_as_one() -> None:
    a, b = NodeKey.generate(), NodeKey.generate()
    trust = ClusterTrust(CLUSTER_KEY, self_vouch=False)
    r = Replica(a.node_id, HLC(), signer=lambda e: sign_entry(a, e), trust=trust)
    r.install([member_entry(a, a), member_entry(b, a)])  # no entry marks an owner
    assert refused(r, written(b, member_key(a.node_id), None)) == {}


def test_a_batch_may_bring_an_approver_with_the_members_it_approved() -> None:
    a, b, c = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    r = replica_of(a)
    # c approved by b, b vouched for by the key; the batch lists c first.
    assert refused(r, member_entry(c, b), member_entry(b, b, proof=True)) == {}
    assert r.map.value(member_key(c.node_id)) is not None


@pytest.mark.parametrize(
    ("key", "size", "why"),
    [("instance/" + "x" * 200_000, 10, "bad_key"), ("bogus/x", 10, "bad_key"),
     ("node/../etc", 10, "bad_key"), ("health/x", 1 << 20, "oversized")],
)  # fmt: skip
def test_keys_outside_the_key_spaces_and_oversized_values_are_refused(
    key: str, size: int, why: str
) -> None:
    a = NodeKey.generate()
    r = replica_of(a)
    e = sign_entry(a, Entry(key, HLC().now(), a.node_id, b"x" * size))
    assert refused(r, e) == {why: 1}
    assert key not in r.map


def test_a_writer_holds_a_bounded_number_of_instances() -> None:
    a, b = NodeKey.generate(), NodeKey.generate()
    r = replica_of(a, plans=False)
    r.merge_remote(
        [member_entry(b, b, proof=True), written(b, node_key(b.node_id), card(b.node_id))]
    )
    taken = 0
    for i in range(MAX_INSTANCES_PER_WRITER + 5):
        inst = planned(f"i{i}", [card(b.node_id)])
        got = r.merge_remote([written(b, instance_key(inst.id), inst)])
        taken += len(got.changed)
    assert taken == MAX_INSTANCES_PER_WRITER


def planned(iid: str, cards: list, spec: InstanceSpec | None = None) -> Instance:
    spec = spec or InstanceSpec(model="m")
    nodes = {c.id: NodeResources(id=c.id, name=c.name, backends=c.backends,
                                 mem_available=c.mem_available, mem_total=c.mem_total,
                                 devices=c.devices)
             for c in cards}  # fmt: skip
    stages = place(spec, FACTS, nodes)
    return Instance(id=iid, spec=spec, stages=stages, facts=FACTS,
                    basis=PlanBasis(spec=spec, nodes=list(nodes.values())))  # fmt: skip


def test_a_card_or_heartbeat_that_no_node_could_read_is_refused() -> None:
    a, b = NodeKey.generate(), NodeKey.generate()
    r = replica_of(a)
    r.merge_remote([member_entry(b, b, proof=True)])
    bad_card = {**msgspec.to_builtins(card(b.node_id)), "mem_total": "lots"}
    bad_beat = {**msgspec.to_builtins(Health(seq=1)), "seq": "x"}
    for key, raw in ((node_key(b.node_id), bad_card), (health_key(b.node_id), bad_beat)):
        e = sign_entry(b, Entry(key, HLC().now(), b.node_id, msgspec.msgpack.encode(raw)))
        assert refused(r, e) == {"bad_value": 1}
        assert key not in r.map


def test_a_secrets_holder_re_stamps_itself_past_an_older_approval() -> None:
    """A restarted secret-file node's own entry (vouched, an owner) is taken by every
    node, whatever approval of it they hold: else the states never agree again."""
    owner, c = NodeKey.generate(), NodeKey.generate()
    r = watching(owner, self_vouch=True)
    assert refused(r, member_entry(c, owner)) == {}  # approved: no proof, no owner
    assert refused(r, member_entry(c, c, proof=True, owner=True)) == {}

"""Typed views: who may write what, and a bad value is skipped, never raised."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.crdt import (
    Health,
    Instance,
    InstanceSpec,
    LWWMap,
    NodeCard,
    RunnerStatus,
    Stage,
    cards,
    healths,
    instances,
)
from meshd.crdt.views import encode, health_key, instance_key, node_key

ids = st.text(alphabet="abcdef0123456789", min_size=1, max_size=8)


def card(node_id: str) -> NodeCard:
    return NodeCard(
        id=node_id,
        name=f"host-{node_id}",
        incarnation="inc-1",
        cluster="home",
        version="0.1.0",
        os="linux",
        arch="x86_64",
        cpu_count=8,
        mem_total=32 << 30,
        mem_available=20 << 30,
        backends=["llama_cpp-cpu"],
        addresses=["192.168.1.10"],
        mesh_port=5555,
        pub_port=5556,
        api_port=8000,
    )


def health(seq: int = 1) -> Health:
    return Health(
        seq=seq,
        mem_available=1 << 30,
        runners=[RunnerStatus(instance="i1", generation=1, state="ready")],
    )


def instance(iid: str) -> Instance:
    return Instance(
        id=iid,
        spec=InstanceSpec(model="qwen2.5-0.5b"),
        stages=[Stage(node="n1", start=0, end=24, engine="llama_cpp-cpu")],
    )


def test_views_read_back_what_was_written() -> None:
    m = LWWMap()
    m.put(node_key("n1"), encode(card("n1")), 1, "n1")
    m.put(health_key("n1"), encode(health(7)), 2, "n1")
    m.put(instance_key("i1"), encode(instance("i1")), 3, "n2")
    assert cards(m) == {"n1": card("n1")}
    assert healths(m) == {"n1": health(7)}
    assert instances(m) == {"i1": instance("i1")}


@settings(max_examples=100, deadline=None)
@given(node_id=ids, writer=ids)
def test_cards_ignore_a_card_written_by_another_writer_than_its_id(
    node_id: str, writer: str
) -> None:
    m = LWWMap()
    m.put(node_key(node_id), encode(card(node_id)), 1, writer)
    assert cards(m) == ({node_id: card(node_id)} if writer == node_id else {})


@settings(max_examples=100, deadline=None)
@given(key_id=ids, card_id=ids)
def test_cards_ignore_a_card_whose_id_is_not_its_key(key_id: str, card_id: str) -> None:
    m = LWWMap()
    m.put(node_key(key_id), encode(card(card_id)), 1, key_id)
    assert cards(m) == ({key_id: card(card_id)} if key_id == card_id else {})


@settings(max_examples=100, deadline=None)
@given(node_id=ids, writer=ids)
def test_healths_ignore_a_heartbeat_written_by_another_writer(node_id: str, writer: str) -> None:
    m = LWWMap()
    m.put(health_key(node_id), encode(health()), 1, writer)
    assert healths(m) == ({node_id: health()} if writer == node_id else {})


@settings(max_examples=100, deadline=None)
@given(key_id=ids, inst_id=ids, writer=ids)
def test_instances_may_come_from_any_writer_but_must_match_their_key(
    key_id: str, inst_id: str, writer: str
) -> None:
    m = LWWMap()
    m.put(instance_key(key_id), encode(instance(inst_id)), 1, writer)
    assert instances(m) == ({key_id: instance(inst_id)} if key_id == inst_id else {})


def test_deleted_entries_are_not_in_the_views() -> None:
    m = LWWMap()
    m.put(node_key("n1"), encode(card("n1")), 1, "n1")
    m.put(instance_key("i1"), encode(instance("i1")), 1, "n1")
    m.delete(node_key("n1"), 2, "n1")
    m.delete(instance_key("i1"), 2, "n1")
    assert cards(m) == {}
    assert instances(m) == {}


@settings(max_examples=300, deadline=None)
@given(garbage=st.lists(st.tuples(ids, st.binary(max_size=64)), max_size=6))
def test_a_value_that_fails_to_decode_is_skipped_not_raised(
    garbage: list[tuple[str, bytes]],
) -> None:
    m = LWWMap()
    m.put(node_key("good"), encode(card("good")), 1, "good")
    m.put(health_key("good"), encode(health()), 1, "good")
    m.put(instance_key("good"), encode(instance("good")), 1, "good")
    for i, (nid, junk) in enumerate(garbage):
        bad = f"bad{i}{nid}"
        m.put(node_key(bad), junk, 2, bad)
        m.put(health_key(bad), junk, 2, bad)
        m.put(instance_key(bad), junk, 2, bad)
    assert cards(m)["good"] == card("good")
    assert healths(m)["good"] == health()
    assert instances(m)["good"] == instance("good")
    assert all(isinstance(v, NodeCard) for v in cards(m).values())
    assert all(isinstance(v, Health) for v in healths(m).values())
    assert all(isinstance(v, Instance) for v in instances(m).values())


def test_a_value_of_the_wrong_type_is_skipped() -> None:
    m = LWWMap()
    m.put(node_key("n1"), encode(health()), 1, "n1")  # a heartbeat where a card belongs
    m.put(health_key("n1"), msgspec.msgpack.encode({"seq": "not an int"}), 1, "n1")
    assert cards(m) == {}
    assert healths(m) == {}


def test_a_value_nested_too_deep_is_skipped_not_raised() -> None:
    # About 2 KiB of nested arrays under an unknown field: msgspec gives up with a
    # RecursionError rather than a DecodeError; a reader must still not crash.
    deep = b"\x81\xa3foo" + b"\x91" * 2000 + b"\xc0"
    m = LWWMap()
    m.put(node_key("n1"), deep, 1, "n1")
    m.put(health_key("n1"), deep, 1, "n1")
    m.put(instance_key("i1"), deep, 1, "n1")
    m.put(node_key("n2"), encode(card("n2")), 1, "n2")
    assert cards(m) == {"n2": card("n2")}
    assert healths(m) == {}
    assert instances(m) == {}


def test_a_value_from_a_newer_node_with_extra_fields_still_decodes() -> None:
    newer = msgspec.to_builtins(health(3))
    newer["gpu_temp_c"] = 71  # a field this version does not know
    m = LWWMap()
    m.put(health_key("n1"), msgspec.msgpack.encode(newer), 1, "n1")
    assert healths(m) == {"n1": health(3)}

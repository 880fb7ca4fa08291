"""Replica rules on remote entries: what is refused, and how forged own-id writes heal."""

from __future__ import annotations

from meshd.crdt.hlc import HLC, pack
from meshd.crdt.lww import Entry
from meshd.crdt.replica import Replica
from meshd.crdt.views import NodeCard, decode, node_key


def _card(nid: str, name: str) -> NodeCard:
    return NodeCard(
        id=nid, name=name, incarnation="i", cluster="c", version="0", os="linux",
        arch="x86_64", cpu_count=2, mem_total=1, mem_available=1, mesh_port=1, pub_port=2,
        api_port=3,
    )  # fmt: skip


def test_a_forged_write_under_our_id_is_refused_and_out_stamped() -> None:
    me = Replica("aaaa")
    mine = me.write(node_key("aaaa"), _card("aaaa", "real"))
    forged = Entry(node_key("aaaa"), mine.hlc + 1000, "aaaa", b"\x80")
    peer = Replica("bbbb")
    peer.merge_remote([mine])
    peer.merge_remote([forged])  # a peer that took the forgery first
    assert peer.map.get(node_key("aaaa")) == forged

    res = me.merge_remote([forged, mine])  # the forgery, and an echo of our own write
    assert res.refused == {"own_id": 1} and res.changed == []
    assert res.reassert == [node_key("aaaa")]
    assert me.map.get(node_key("aaaa")) == mine  # unchanged here
    fixes = me.reassert(res.reassert)
    assert fixes[0].hlc > forged.hlc
    peer.merge_remote(fixes)
    card = decode(peer.map.value(node_key("aaaa")) or b"", NodeCard)
    assert card is not None and card.name == "real"


def test_a_forged_key_we_never_wrote_is_tombstoned() -> None:
    me = Replica("aaaa")
    forged = Entry("instance/evil", me.clock.now() + 10, "aaaa", b"x")
    res = me.merge_remote([forged])
    assert res.reassert == ["instance/evil"] and "instance/evil" not in me.map
    (fix,) = me.reassert(res.reassert)
    assert fix.value is None and fix.hlc > forged.hlc


def test_entries_from_an_earlier_run_of_our_id_are_taken() -> None:
    clock = HLC()
    old = Entry("instance/x", pack(1, 0), "aaaa", b"v")
    me = Replica("aaaa", clock)
    res = me.merge_remote([old])
    assert res.changed == [old] and not res.refused

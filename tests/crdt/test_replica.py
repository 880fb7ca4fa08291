"""Replica rules on remote entries: what is refused, and how forged own-id writes heal."""

from __future__ import annotations

from meshd.crdt.hlc import HLC, pack
from meshd.crdt.lww import Entry
from meshd.crdt.replica import Replica
from meshd.crdt.views import Health, NodeCard, decode, encode, health_key, instance_key, node_key


class Wall:
    """A wall clock a test sets by hand (ms)."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


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


def test_echoes_of_our_own_older_writes_are_ignored_not_counted() -> None:
    """A Welcome or a pull reply returns heartbeat n-1 while we already wrote n: an echo,
    not a clash (was: counted as own_id and logged as another process)."""
    me = Replica("aaaa")
    old = me.write(health_key("aaaa"), Health(seq=1))
    new = me.write(health_key("aaaa"), Health(seq=2))
    res = me.merge_remote([old, new, old])
    assert res.refused == {} and res.reassert == [] and res.clashes == []
    assert me.map.get(health_key("aaaa")) == new


def test_an_entry_above_our_last_write_is_a_clash() -> None:
    me = Replica("aaaa")
    mine = me.write(health_key("aaaa"), Health(seq=1))
    newer = Entry(health_key("aaaa"), mine.hlc + 1, "aaaa", encode(Health(seq=9)))
    res = me.merge_remote([newer])
    assert res.refused == {"own_id": 1} and res.clashes == [newer]
    assert res.reassert == [health_key("aaaa")]


def test_a_forgotten_node_re_announces_itself_on_seeing_its_card_tombstoned() -> None:
    me, peer = Replica("aaaa"), Replica("bbbb")
    card = me.write(node_key("aaaa"), _card("aaaa", "a"))
    peer.merge_remote([card])
    peer.clock.observe(card.hlc)
    tomb = peer.delete(node_key("aaaa"))  # bbbb forgot aaaa after a long silence
    res = me.merge_remote([tomb])
    assert res.evicted and res.reassert == [node_key("aaaa")] and not res.refused
    assert me.map.get(node_key("aaaa")) == card  # our card stays here
    (fix,) = me.reassert(res.reassert)
    assert fix.hlc > tomb.hlc and fix.value == card.value
    assert peer.merge_remote([fix]).changed == [fix]
    # An old eviction arriving after the re-stamp is no news.
    assert not me.merge_remote([tomb]).evicted


def test_a_survivor_tombstone_of_another_nodes_card_is_taken_but_a_value_is_not() -> None:
    me = Replica("aaaa")
    card = Entry(node_key("cccc"), pack(10, 0), "cccc", encode(_card("cccc", "c")))
    assert me.merge_remote([card]).changed == [card]
    forged = Entry(node_key("cccc"), pack(11, 0), "bbbb", encode(_card("cccc", "x")))
    assert me.merge_remote([forged]).refused == {"foreign_owner": 1}
    tomb = Entry(node_key("cccc"), pack(12, 0), "bbbb", None)
    assert me.merge_remote([tomb]).changed == [tomb]
    assert node_key("cccc") not in me.map


def test_a_node_that_ran_alone_is_seen_after_the_clusters_horizon_moved() -> None:
    """Its card, its heartbeat and the instance it wrote alone are older than the
    horizon of a cluster it never belonged to: all taken (was: below_horizon forever)."""
    a, b = Replica("aaaa", HLC(Wall(1_000))), Replica("bbbb", HLC(Wall(1_000)))
    loner = Replica("llll", HLC(Wall(1_000)))
    mine = [
        loner.write(node_key("llll"), _card("llll", "l")),
        loner.write(health_key("llll"), Health(seq=1)),
        loner.write(instance_key("x"), Health(seq=0)),
    ]
    for r in (a, b):
        r.clock.wall.ms = 100_000  # type: ignore[attr-defined]
        r.write(node_key(r.node_id), _card(r.node_id, r.node_id))
    a.merge_remote(b.map.entries())
    b.merge_remote(a.map.entries())
    for r in (a, b):
        r.map.collect(pack(90_000, 0), ["aaaa", "bbbb"])
    res = a.merge_remote(mine)
    assert res.changed == mine and not res.refused
    b.merge_remote(a.map.entries())
    loner.clock.wall.ms = 100_000  # type: ignore[attr-defined]
    loner.merge_remote(a.map.entries())
    assert a.map.root() == b.map.root() == loner.map.root()


def test_a_stale_copy_of_a_collected_delete_is_still_refused() -> None:
    """The no-resurrection guarantee holds for every writer that was a member."""
    a, b = Replica("aaaa", HLC(Wall(1_000))), Replica("bbbb", HLC(Wall(1_000)))
    inst = b.write(instance_key("x"), Health(seq=0))
    a.merge_remote([inst])
    stale = b.map.copy()  # b's state, say, before the delete
    a.clock.wall.ms = b.clock.wall.ms = 30_000  # type: ignore[attr-defined]
    b.merge_remote([a.delete(instance_key("x"))])
    for r in (a, b):
        assert r.map.collect(pack(40_000, 0), ["aaaa", "bbbb"]) == 1
    res = a.merge_remote(stale.entries())
    assert res.refused == {"below_horizon": 1} and instance_key("x") not in a.map

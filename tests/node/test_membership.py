"""Membership in one process: liveness from merged heartbeats, transitions that wake
waiters, forgetting the silent, and a lone node that collects no tombstone."""

from __future__ import annotations

import asyncio
import time

from meshd.crdt.views import health_key, instance_key, node_key
from meshd.node.membership import Membership
from meshd.node.peers import Peers

from .local import Local, local_node
from .test_cluster_view import card, health, inst

FORGET = 5.0
DEAD = 2.0


def membership(n: Local) -> Membership:
    n.state.replica.write(node_key("a"), card("a"))  # this node's own card
    peers = Peers(
        n.state, n.gossip, n.tasks, own_addresses=["127.0.0.1"], virtual=set(), seeds=[],
        hello_interval=2.0,
    )  # fmt: skip
    return Membership(n.state, n.gossip, peers, dead_after=DEAD, forget_after=FORGET,
                      tombstone_grace_ms=0)  # fmt: skip


async def test_a_heartbeat_makes_its_node_alive_and_a_new_card_is_a_topology_change() -> None:
    async with local_node() as n:
        m = membership(n)
        assert m.on_entries([n.from_peer("b", node_key("b"), card("b"))])
        assert m.on_entries([n.from_peer("b", health_key("b"), health())])
        assert n.state.is_alive("b")
        # The same state and runners again: liveness moves on, the topology does not.
        assert not m.on_entries([n.from_peer("b", health_key("b"), health())])
        # Points the gossip sockets at the card's address.
        assert "b" in n.gossip.peers()


async def test_a_liveness_transition_wakes_whoever_waits_on_the_cluster() -> None:
    async with local_node() as n:
        m = membership(n)
        m.on_entries([n.from_peer("b", health_key("b"), health())])
        m.tick(time.monotonic())  # b: alive, seen
        waiter = asyncio.ensure_future(n.state.changes.wait(5.0))
        await asyncio.sleep(0)
        m.tick(time.monotonic() + 1.5)  # silent past suspect_after
        assert await asyncio.wait_for(waiter, 1.0) is True


async def test_a_card_never_heard_from_is_forgotten_after_dead_plus_forget_after() -> None:
    async with local_node() as n:
        m = membership(n)
        m.on_entries([n.from_peer("b", node_key("b"), card("b"))])
        t0 = time.monotonic()
        assert set(m.members(t0)) == {"a", "b"}  # starts b's silence clock
        assert not m.forgotten("b", t0 + DEAD + FORGET - 0.1)
        assert m.forgotten("b", t0 + DEAD + FORGET + 0.1)
        m.forget_silent(t0 + DEAD + FORGET + 0.1)
        held = n.state.map.get(node_key("b"))
        assert held is not None and held.value is None  # tombstoned by this node
        assert m.members() == ["a"]


async def test_a_node_that_left_stops_counting_at_once_and_is_forgotten_later() -> None:
    async with local_node() as n:
        m = membership(n)
        m.on_entries([n.from_peer("b", node_key("b"), card("b"))])
        m.on_entries([n.from_peer("b", health_key("b"), health(state="stopped"))])
        now = time.monotonic()
        assert n.state.liveness.state("b", now) == "left"
        assert m.members(now) == ["a"]  # a goodbye does not hold the horizon back
        assert not m.forgotten("b", now + FORGET - 0.1)
        assert m.forgotten("b", now + FORGET + 0.1)


async def test_a_lone_node_keeps_its_tombstones() -> None:
    async with local_node() as n:
        m = membership(n)
        n.state.write(instance_key("x"), inst("x", "a"))
        n.state.delete(instance_key("x"))
        m.collect_tombstones()
        held = n.state.map.get(instance_key("x"))
        assert held is not None and held.value is None

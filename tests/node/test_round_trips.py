"""A node measures its round trip to each peer from the mesh requests it makes (the
least of the recent ones), and placement reads it from its heartbeat."""

from __future__ import annotations

import asyncio

import pytest

from meshd.transport.gossip import Endpoint

from .local import local_node

pytestmark = pytest.mark.timeout(30)


def test_a_pull_from_a_peer_measures_the_round_trip_to_it() -> None:
    async def go() -> dict[str, float]:
        async with local_node("a") as a, local_node("b") as b:
            a.gossip.start()
            b.gossip.start()
            assert a.gossip.rtt_ms() == {}
            a.gossip.set_peer("b", Endpoint("127.0.0.1", b.gossip.mesh_port, b.gossip.pub_port))
            for _ in range(5):
                assert await a.gossip.pull("b")
            return a.gossip.rtt_ms()

    rtt = asyncio.run(go())
    # Loopback, both ends in this process: well under the 1 ms a LAN hop takes.
    assert set(rtt) == {"b"} and 0 < rtt["b"] < 50, rtt

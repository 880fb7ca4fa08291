"""A node measures its round trip to each peer from the mesh requests it makes (the
least of the recent ones), and the bandwidth of the link from those that carry many
bytes (a pull padded as a probe now and then); placement reads both from its heartbeat."""

from __future__ import annotations

import asyncio
import time

import pytest

from meshd.transport.gossip import Endpoint
from meshd.transport.links import MIN_SAMPLE_BYTES, LinkMeter, sample_rate
from meshd.transport.mesh_peers import PROBE_BYTES

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


def test_a_probe_measures_the_bandwidth_of_the_link_once_and_not_its_round_trip() -> None:
    async def go() -> tuple[dict[str, float], dict[str, float], int, float]:
        async with local_node("a") as a, local_node("b") as b:
            b.gossip.start()  # a's requests await their own replies
            a.gossip.set_peer("b", Endpoint("127.0.0.1", b.gossip.mesh_port, b.gossip.pub_port))
            mesh = a.gossip.mesh
            assert await a.gossip.pull("b")  # the round trip first: the probe's is read on it
            # Small requests say nothing about bandwidth: no figure, not a zero.
            small = mesh.bw_mbps()
            trips = len(mesh.links["b"].rtts)
            # The next pull carries the probe's padding (b's ROUTER reads the message
            # frame alone, as every meshd does), and answers as any pull.
            assert mesh.probe_due("b")
            t0 = time.monotonic()
            assert await a.gossip.pull("b")
            took = time.monotonic() - t0
            assert len(mesh.links["b"].rtts) == trips  # its wire time is no round trip
            assert not mesh.probe_due("b")
            for _ in range(3):  # and not again within the interval (minutes)
                assert await a.gossip.pull("b")
            return small, mesh.bw_mbps(), mesh.meter.samples("b"), took

    small, bw, samples, took = asyncio.run(go())
    assert small == {} and samples == 1
    # The figure is the probe's bytes over its time less the round trip: at least
    # their rate over the whole pull as timed here (on a loaded machine loopback is
    # slow too: no absolute figure holds).
    assert set(bw) == {"b"} and bw["b"] >= PROBE_BYTES * 8 / 1e6 / took * 0.99, (bw, took)


def test_the_bandwidth_figure_ignores_small_requests_and_decays_towards_new_samples() -> None:
    m = LinkMeter()
    assert not m.sample("b", MIN_SAMPLE_BYTES - 1, 1.0, 0.001, now=1.0)
    assert m.mbps() == {} and m.last("b") is None
    # 1 MB in 1.001 s over a 1 ms round trip: 8 Mbit/s.
    assert m.sample("b", 1_000_000, 1.001, 0.001, now=2.0)
    assert m.mbps() == {"b": 8.0}
    # A sample 4x faster moves the figure half way, geometrically: 2x.
    m.sample("b", 1_000_000, 0.251, 0.001, now=3.0)
    assert m.mbps()["b"] == pytest.approx(16.0, rel=1e-3) and m.last("b") == 3.0
    # A request quicker than its link's round trip counts at half its time at most.
    assert sample_rate(MIN_SAMPLE_BYTES, 0.001, 0.002) == MIN_SAMPLE_BYTES / 0.0005
    m.forget("b")
    assert m.mbps() == {}

"""Bonjour discovery over real zeroconf, between real processes in network namespaces."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from meshd.transport.addresses import choose_address, local_addresses
from meshd.transport.discovery import SERVICE_TYPE, Discovery, PeerAddr
from tests.netns import Host, Netns, require_netns

REPO_ROOT = Path(__file__).resolve().parents[2]

#: A node in a child process: starts Discovery, prints JSON lines, stops on SIGTERM.
NODE_SCRIPT = r"""
import asyncio, json, signal, sys
from meshd.transport.addresses import local_addresses
from meshd.transport.discovery import Discovery

cfg = json.loads(sys.argv[1])

def emit(**event):
    print(json.dumps(event), flush=True)

async def main():
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    addresses = cfg["addresses"] or local_addresses()
    disc = Discovery(
        node_id=cfg["node_id"], name=cfg["node_id"], cluster_hash=cfg["cluster"],
        mesh_port=cfg["mesh_port"], api_port=cfg["mesh_port"] + 1, version="test",
        addresses=addresses, interfaces=cfg["interfaces"],
        on_peer=lambda p: emit(event="peer", node_id=p.node_id, host=p.host, port=p.port),
        on_peer_lost=lambda node_id: emit(event="lost", node_id=node_id),
    )
    await disc.start()
    emit(event="ready", addresses=addresses)
    ignored = 0
    deadline = loop.time() + cfg["max_s"]
    while not stop.is_set() and loop.time() < deadline:
        if disc.ignored_other_cluster != ignored:
            ignored = disc.ignored_other_cluster
            emit(event="ignored", count=ignored)
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass
    await disc.stop()
    await disc.stop()
    emit(event="stopped", ignored=disc.ignored_other_cluster)

asyncio.run(main())
"""


class Node:
    """A Discovery process in a namespace, whose JSON-line events we can wait for."""

    def __init__(
        self,
        host: Host,
        node_id: str,
        cluster: str,
        mesh_port: int,
        *,
        interfaces: list[str] | None = None,
        max_s: float = 40,
    ) -> None:
        self.host, self.node_id, self.mesh_port = host, node_id, mesh_port
        cfg = {
            "node_id": node_id,
            "cluster": cluster,
            "mesh_port": mesh_port,
            "addresses": None,  # the child asks local_addresses() inside its namespace
            "interfaces": interfaces,
            "max_s": max_s,
        }
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.proc = host.popen(
            [sys.executable, "-c", NODE_SCRIPT, json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                self._queue.put(json.loads(line))
        self._queue.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self._stderr.extend(self.proc.stderr)

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        """The first event (seen or coming) matching ``pred``, within ``timeout`` s."""
        for event in self.events:
            if pred(event):
                return event
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if event is None:
                raise AssertionError(f"{self.node_id} exited early: {self.stderr()}")
            self.events.append(event)
            if pred(event):
                return event
        raise AssertionError(
            f"{self.node_id}: no matching event in {timeout} s; events {self.events}; "
            f"stderr: {self.stderr()}"
        )

    def drain(self) -> list[dict[str, Any]]:
        """All events so far, without waiting."""
        while True:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                return self.events
            if event is not None:
                self.events.append(event)

    def peers(self) -> list[dict[str, Any]]:
        return [e for e in self.drain() if e["event"] == "peer"]

    def stop(self, timeout: float = 8) -> dict[str, Any]:
        """SIGTERM, then the ``stopped`` event (the child stops Discovery twice)."""
        self.proc.terminate()
        return self.wait_for(lambda e: e["event"] == "stopped", timeout)

    def stderr(self) -> str:
        return "".join(self._stderr)[-2000:]


@pytest.fixture
def lan_factory() -> Iterator[Callable[[int], Any]]:
    """Build a namespace LAN (failing, not skipping, when that is impossible)."""
    lans = []

    def make(n: int) -> Any:
        require_netns()
        lan = Netns.lan(n=n, prefix="mdtdisc").__enter__()
        lans.append(lan)
        return lan

    yield make
    for lan in lans:
        lan.close()


def is_peer(node: Node) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "peer" and e["node_id"] == node.node_id


# -- real zeroconf between namespaces -----------------------------------------------------


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_two_nodes_find_each_other_over_bonjour(lan_factory: Callable[[int], Any]) -> None:
    lan = lan_factory(2)
    cluster = uuid.uuid4().hex
    a = Node(lan.hosts[0], "node-a", cluster, 5550)
    b = Node(lan.hosts[1], "node-b", cluster, 6660)

    found_b = a.wait_for(is_peer(b), timeout=10)
    found_a = b.wait_for(is_peer(a), timeout=10)

    assert (found_b["host"], found_b["port"]) == (lan.hosts[1].ip, 6660)
    assert (found_a["host"], found_a["port"]) == (lan.hosts[0].ip, 5550)
    ready = a.wait_for(lambda e: e["event"] == "ready", timeout=5)
    assert ready["addresses"] == [lan.hosts[0].ip, "127.0.0.1"]  # local_addresses() in ns
    for node in (a, b):  # nobody reports itself, nor the same peer twice
        assert [p["node_id"] for p in node.peers()] == [(b if node is a else a).node_id]


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_other_cluster_is_ignored(lan_factory: Callable[[int], Any]) -> None:
    lan = lan_factory(3)
    ours, theirs = uuid.uuid4().hex, uuid.uuid4().hex
    a = Node(lan.hosts[0], "node-a", ours, 5550, interfaces=[lan.hosts[0].ip])
    b = Node(lan.hosts[1], "node-b", ours, 5550, interfaces=[lan.hosts[1].ip])
    stranger = Node(lan.hosts[2], "node-x", theirs, 5550, interfaces=[lan.hosts[2].ip])

    a.wait_for(is_peer(b), timeout=10)  # the network works ...
    a.wait_for(lambda e: e["event"] == "ignored" and e["count"] == 1, timeout=10)
    stranger.wait_for(lambda e: e["event"] == "ignored" and e["count"] == 2, timeout=10)

    assert [p["node_id"] for p in a.peers()] == ["node-b"]  # ... and x was seen, not kept
    assert stranger.peers() == []
    assert a.stop()["ignored"] == 1


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_stopped_node_is_seen_leaving(lan_factory: Callable[[int], Any]) -> None:
    lan = lan_factory(2)
    cluster = uuid.uuid4().hex
    a = Node(lan.hosts[0], "node-a", cluster, 5550)
    b = Node(lan.hosts[1], "node-b", cluster, 5550)
    a.wait_for(is_peer(b), timeout=10)

    t0 = time.monotonic()
    b.stop()  # unregisters: zeroconf sends goodbye packets
    a.wait_for(lambda e: e["event"] == "lost" and e["node_id"] == "node-b", timeout=5)
    assert time.monotonic() - t0 < 5


# -- in one process, on loopback only -----------------------------------------------------


@pytest.mark.timeout(30)
async def test_discovery_on_loopback_in_one_loop_and_stop_is_idempotent() -> None:
    cluster = uuid.uuid4().hex
    found: dict[str, list[PeerAddr]] = {"a": [], "b": []}

    def make(key: str, node_id: str, port: int) -> Discovery:
        return Discovery(
            node_id=node_id,
            name=key,
            cluster_hash=cluster,
            mesh_port=port,
            api_port=port + 1,
            version="test",
            addresses=["127.0.0.1"],
            on_peer=found[key].append,
            interfaces=["127.0.0.1"],
            join_port=port + 2,
        )

    a = make("a", f"lo-a-{uuid.uuid4().hex[:8]}", 41000)
    b = make("b", f"lo-b-{uuid.uuid4().hex[:8]}", 42000)
    try:
        await asyncio.gather(a.start(), b.start())
        async with asyncio.timeout(10):
            while not (found["a"] and found["b"]):
                await asyncio.sleep(0.05)
    finally:
        t0 = time.monotonic()
        await asyncio.gather(a.stop(), b.stop())
        await a.stop()  # a second stop is a no-op
        assert time.monotonic() - t0 < 10
    assert found["a"] == [
        PeerAddr(node_id=b.node_id, host="127.0.0.1", port=42000, cluster=cluster, join=42002)
    ]
    assert found["b"] == [
        PeerAddr(node_id=a.node_id, host="127.0.0.1", port=41000, cluster=cluster, join=41002)
    ]
    assert a.service_name.endswith(SERVICE_TYPE)


@pytest.mark.timeout(30)
async def test_updated_record_is_reported_again() -> None:
    cluster = uuid.uuid4().hex
    found: list[PeerAddr] = []
    disc = Discovery(
        node_id=f"lo-{uuid.uuid4().hex[:8]}",
        name="watcher",
        cluster_hash=cluster,
        mesh_port=43000,
        api_port=43001,
        version="test",
        addresses=["127.0.0.1"],
        on_peer=found.append,
        interfaces=["127.0.0.1"],
    )
    peer_id = f"lo-peer-{uuid.uuid4().hex[:8]}"

    def peer_info(mesh_port: int) -> AsyncServiceInfo:
        txt = {"id": peer_id, "c": cluster, "mesh": str(mesh_port), "api": "1", "v": "t"}
        return AsyncServiceInfo(
            SERVICE_TYPE,
            f"{peer_id}.{SERVICE_TYPE}",
            port=mesh_port,
            properties=txt,
            server=f"{peer_id}.local.",
            parsed_addresses=["127.0.0.1"],
        )

    # A bare zeroconf responder stands in for the peer, so we can change its record.
    peer = AsyncZeroconf(interfaces=["127.0.0.1"])
    try:
        await disc.start()
        await (await peer.async_register_service(peer_info(44000)))
        async with asyncio.timeout(10):
            while not found:
                await asyncio.sleep(0.05)
        await (await peer.async_update_service(peer_info(45000)))
        async with asyncio.timeout(10):
            while len(found) < 2:
                await asyncio.sleep(0.05)
    finally:
        await disc.stop()
        await asyncio.wait_for(peer.async_close(), 5)
    assert [p.port for p in found] == [44000, 45000]
    assert {(p.node_id, p.host) for p in found} == {(peer_id, "127.0.0.1")}


# -- pure helpers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("own", "peer", "expected"),
    [
        # same /24 wins over earlier addresses on other networks
        (["192.168.1.5", "127.0.0.1"], ["10.0.0.7", "192.168.1.9"], "192.168.1.9"),
        # the peer lists one of our own addresses: same host, use loopback
        (["192.168.1.5", "127.0.0.1"], ["10.8.0.2", "192.168.1.5"], "127.0.0.1"),
        # sharing only loopback does not make it the same host
        (["192.168.1.5", "127.0.0.1"], ["127.0.0.1", "10.0.0.7"], "10.0.0.7"),
        # no shared subnet: first non-loopback, non-link-local
        (["192.168.1.5"], ["127.0.0.1", "169.254.3.4", "172.16.0.1"], "172.16.0.1"),
        # only link-local beside loopback: take the link-local one
        (["192.168.1.5"], ["127.0.0.1", "169.254.3.4"], "169.254.3.4"),
        # a peer that only advertises loopback
        (["192.168.1.5"], ["127.0.0.1"], "127.0.0.1"),
        # /24 heuristic: same first three octets only
        (["10.1.2.3"], ["10.1.3.4", "10.1.2.200"], "10.1.2.200"),
        # we know no address of our own: first usable
        ([], ["10.1.3.4", "10.1.2.200"], "10.1.3.4"),
    ],
)
def test_choose_address(own: list[str], peer: list[str], expected: str) -> None:
    assert choose_address(own, peer) == expected


def test_choose_address_refuses_an_empty_peer_list() -> None:
    with pytest.raises(ValueError):
        choose_address(["10.0.0.1"], [])


def test_local_addresses_put_loopback_last() -> None:
    addrs = local_addresses()
    assert addrs[-1] == "127.0.0.1"
    loopback = [a.startswith("127.") for a in addrs]
    assert loopback == sorted(loopback)  # every non-loopback address comes first
    assert all(":" not in a for a in addrs)

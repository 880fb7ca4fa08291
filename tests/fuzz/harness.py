"""The node under fuzz, the checks run after every batch, and the figures reported.

One real `meshd up` process (node ``a``) serves the default model on one runner.
Beside it the tests pose as a peer (``fake``): a card whose PUB and mesh ROUTER are our
own sockets, so node ``a`` subscribes to our PUB and sends its pulls to our ROUTER.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq
from hypothesis import HealthCheck, Phase, settings

from meshd.crdt.hlc import HLC
from meshd.crdt.lww import Entry
from meshd.crdt.views import NodeCard, encode, node_key
from meshd.models.resolve import DEFAULT_MODEL
from meshd.transport import wire
from tests.cluster import Cluster, NodeProc, wait_for

from .frames import Target

#: The greedy completion compared before and after every batch (exact: no prefix a
#: fuzzed request left may move it).
PROMPT = {"model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 8,
          "temperature": 0, "exact": True}  # fmt: skip
FAKE_ID = "f00dfacef00dface"


def fuzz_settings(n: int) -> settings:
    """``n`` examples, no deadline, no shrinking (a live node is not a pure function),
    the same examples on every run (CI is reproducible).

    ``MESHD_FUZZ_SCALE=10`` runs ten times as many; ``MESHD_FUZZ_RANDOM=1`` draws new
    examples on every run (for hunting, not for CI).
    """
    scale = float(os.environ.get("MESHD_FUZZ_SCALE", "1"))
    return settings(
        max_examples=max(1, int(n * scale)),
        deadline=None,
        derandomize=not os.environ.get("MESHD_FUZZ_RANDOM"),
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


@dataclass
class Figures:
    """What the fuzz run did, printed at the end of the session (see conftest.py)."""

    frames: dict[str, int] = field(default_factory=dict)
    #: Generated but not sent: a correct node could act on them (see frames.harmless,
    #: test_api._screen).
    skipped_frames: int = 0
    crashes: int = 0
    api_cases: int = 0
    api_server_errors: int = 0
    api_status: dict[int, int] = field(default_factory=dict)
    checks: int = 0

    def frame(self, socket: str, n: int = 1) -> None:
        self.frames[socket] = self.frames.get(socket, 0) + n

    def lines(self) -> list[str]:
        total = sum(self.frames.values())
        per = ", ".join(f"{k} {v}" for k, v in sorted(self.frames.items()))
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(self.api_status.items()))
        return [
            f"frames fuzzed: {total} ({per})",
            f"generated but not sent (a correct node would act on them): {self.skipped_frames}",
            f"crashes (node exits + runner restarts): {self.crashes}",
            f"API cases: {self.api_cases}; 5xx: {self.api_server_errors}; statuses: {codes}",
            f"post-batch checks passed: {self.checks}",
        ]


FIGURES = Figures()


_CLIENTS: dict[str, httpx.Client] = {}


def client(node: NodeProc) -> httpx.Client:
    """A shared keep-alive client for ``node``'s API."""
    if node.api not in _CLIENTS:
        _CLIENTS[node.api] = httpx.Client(base_url=node.api, timeout=60.0)
    return _CLIENTS[node.api]


def close_clients() -> None:
    for c in _CLIENTS.values():
        c.close()
    _CLIENTS.clear()


def get(node: NodeProc, path: str) -> Any:
    r = client(node).get(path)
    r.raise_for_status()
    return r.json()


def post(node: NodeProc, path: str, body: dict) -> httpx.Response:
    return client(node).post(path, json=body)


def completion(node: NodeProc) -> str:
    """The greedy completion of :data:`PROMPT`."""
    r = post(node, "/v1/completions", PROMPT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stable_state(node: NodeProc) -> dict[str, Any]:
    """The replicated state minus what moves by itself (heartbeats, liveness, load).

    ``entries`` counts every key held, so an accepted entry under a key no view reads
    shows up too.
    """
    cl = get(node, "/v1/cluster")
    return {
        "nodes": sorted(json.dumps([m["id"], m["card"]], sort_keys=True) for m in cl["nodes"]),
        "instances": sorted(json.dumps(i, sort_keys=True) for i in cl["instances"]),
        "entries": get(node, "/healthz")["entries"],
    }


def dropped(node: NodeProc) -> dict[str, dict[str, int]]:
    return get(node, "/healthz")["dropped"]


def total(counters: dict[str, dict[str, int]], socket: str) -> int:
    return sum(counters.get(socket, {}).values())


@dataclass
class Env:
    """The node under fuzz and our sockets beside it."""

    cluster: Cluster
    node: NodeProc
    ctx: zmq.Context
    instance: str
    reference: str
    baseline: dict[str, Any]
    target: Target
    #: Our PUB, which node ``a`` subscribes to (the fake peer's card points at it).
    pub: zmq.Socket
    #: Our ROUTER on the fake peer's mesh port: node ``a`` sends it hellos and pulls.
    fake_mesh: zmq.Socket
    #: Our ROUTER where runners send typed refusals (``reply_to`` of fuzzed requests).
    sink: zmq.Socket

    def runner(self, timeout: float = 30.0) -> dict[str, Any]:
        """Node a's runner status once it is ready (port, generation)."""

        def ready() -> dict[str, Any] | None:
            nodes = get(self.node, "/v1/cluster")["nodes"]
            me = next(m for m in nodes if m["id"] == self.node.node_id)
            rs = [r for r in (me["health"] or {}).get("runners", []) if r["state"] == "ready"]
            return rs[0] if rs and rs[0].get("port") else None

        return wait_for(ready, timeout, interval=0.05)

    def log_mark(self) -> int:
        return len(self.node.log())

    def log_since(self, mark: int) -> str:
        return self.node.log()[mark:]

    def check(self, mark: int, what: str) -> None:
        """After a batch: alive, healthy, same state, no crash, same greedy text."""
        n = self.node
        assert n.alive(), f"node died during {what}:\n{n.log()[-4000:]}"
        h = client(n).get("/healthz")
        assert h.status_code == 200 and h.json()["status"] == "ok", h.text
        assert stable_state(n) == self.baseline, f"state changed during {what}"
        counters = dropped(n)
        for sock in ("mesh", "gossip", "data", "request"):
            assert counters.get(sock, {}).get("error", 0) == 0, (
                f"{sock} loop caught an exception during {what}: {counters}\n"
                f"{self.log_since(mark)[-4000:]}"
            )
        self.runner()
        assert completion(n) == self.reference, f"greedy text changed after {what}"
        log = self.log_since(mark)
        restarts = log.count("restarting in")
        FIGURES.crashes += restarts
        assert restarts == 0, f"a runner crashed during {what}:\n{log[-4000:]}"
        assert "Traceback" not in log, f"an exception was logged during {what}:\n{log[-6000:]}"
        FIGURES.checks += 1


def pose_as_peer(
    env_cluster: Cluster,
    node: NodeProc,
    ctx: zmq.Context,
    fake_id: str = FAKE_ID,
    extra: list[Entry] | None = None,
):
    """Bind a PUB and a ROUTER and greet ``node`` with a card pointing at them (plus
    ``extra`` entries); return (topic, pub, router) once ``node`` reads our PUB."""
    topic = wire.cluster_hash(env_cluster.cluster_name)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    mesh = ctx.socket(zmq.ROUTER)
    mesh.setsockopt(zmq.LINGER, 0)
    mesh_port = mesh.bind_to_random_port("tcp://127.0.0.1")
    card = NodeCard(
        id=fake_id, name="fake", incarnation="1", cluster=env_cluster.cluster_name,
        version="0", os="linux", arch="x86_64", cpu_count=1, mem_total=1, mem_available=1,
        addresses=["127.0.0.1"], mesh_port=mesh_port, pub_port=pub_port, api_port=1,
    )  # fmt: skip
    entry = Entry(node_key(fake_id), HLC().now(), fake_id, encode(card))
    hello = wire.Hello(
        sender=fake_id, cluster=topic, incarnation="1", entries=[entry, *(extra or [])]
    )
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{node.mesh_port}")
    try:
        d.send(wire.encode(hello))
        assert d.poll(5000), "no Welcome for the fake peer"
        assert isinstance(wire.decode_gossip(d.recv_multipart()[0]), wire.Welcome)
    finally:
        d.close()

    # Node a now dials our PUB; wait until what we publish reaches it.
    seen = dropped(node).get("gossip", {}).get("malformed", 0)

    def subscribed() -> bool:
        pub.send_multipart([topic, b"\xc1 probe"])
        time.sleep(0.05)
        return dropped(node).get("gossip", {}).get("malformed", 0) > seen

    wait_for(subscribed, 10)
    return topic, pub, mesh

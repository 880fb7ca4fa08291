"""The bugs the fuzzers found, one minimal repro each.

Each test's docstring says what the bug was; all are fixed. Repros that broke the node
they hit run on a node of their own; the others use node ``a``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import zmq

from meshd.api import schemas
from meshd.crdt.hlc import HLC
from meshd.crdt.lww import N_BUCKETS, Entry
from meshd.crdt.views import Health, NodeCard, encode, health_key, node_key
from meshd.domain.job import Job
from meshd.domain.sampling import Sampling
from meshd.models.resolve import DEFAULT_MODEL
from meshd.transport import wire
from tests.cluster import Cluster, NodeProc, wait_for

from .harness import FAKE_ID, Env, client, dropped, get, pose_as_peer, post

pytestmark = pytest.mark.timeout(60)

#: Invalid UTF-8 inside a msgpack string: msgspec raises UnicodeDecodeError, which
#: wire.decode does not turn into FrameError.
BAD_UTF8 = msgspec.msgpack.encode({"type": "Pull", "sender": "x", "buckets": []}).replace(
    b"\xa1x", b"\xa1\xff"
)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _send(ctx: zmq.Context, port: int, *frames: bytes) -> None:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 1000)
    d.connect(f"tcp://127.0.0.1:{port}")
    d.send_multipart(list(frames))
    d.close()


def _restarted(env: Env, port: int, within: float = 1.0) -> bool:
    """Whether node a's runner goes down (or comes back elsewhere) within ``within`` s."""

    def changed() -> bool:
        me = get(env.node, "/v1/cluster")["nodes"]
        rs = next(m for m in me if m["id"] == env.node.node_id)["health"]["runners"]
        return not rs or rs[0]["state"] != "ready" or rs[0].get("port") != port

    try:
        return wait_for(changed, within)
    except TimeoutError:
        return False


def _gone(n: NodeProc, within: float = 1.0) -> bool:
    try:
        return wait_for(lambda: not n.alive(), within)
    except TimeoutError:
        return False


# -- fixed in meshd/api/schemas.py ---------------------------------------------------
@pytest.mark.parametrize("model", ["   ", "\t\n"])
def test_a_blank_model_name_is_refused_by_the_schema(model: str) -> None:
    """Was a 500: model resolution strips the name and raises ValueError on nothing."""
    cases = [
        (schemas.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
        (schemas.CompletionRequest, {"prompt": "x"}),
    ]
    for typ, extra in cases:
        with pytest.raises(msgspec.ValidationError, match="model must be a non-empty"):
            msgspec.json.decode(msgspec.json.encode({"model": model, **extra}), type=typ)


@pytest.mark.parametrize("field", ["top_k", "max_tokens", "n", "best_of"])
def test_integers_beyond_64_bits_are_refused_by_the_schema(field: str) -> None:
    """Was a 500: top_k = 2**70 passed validation and broke the msgpack encoder."""
    body = {"model": "m", "prompt": "x", field: 2**70}
    with pytest.raises(msgspec.ValidationError, match=f"{field} must fit in a signed 64-bit"):
        msgspec.json.decode(msgspec.json.encode(body), type=schemas.CompletionRequest)


# -- fixed in d6b9637: meshd/transport/wire.py ----------------------------------------
def test_invalid_utf8_in_a_frame_is_dropped_and_counted(cluster: Cluster, ctx: zmq.Context) -> None:
    """Was: one 14-byte frame made the mesh loop log a traceback (counted as ``error``)
    and killed the data-plane receive loop silently, so every later request on the node
    timed out after 30 s (504)."""
    n = cluster.start("u", extra_args=["--open"])
    data_port = get(n, "/healthz")["data_port"]
    _send(ctx, n.mesh_port, BAD_UTF8)
    _send(ctx, data_port, BAD_UTF8)
    _send(ctx, data_port, b"\xc1")  # counted only if the loop still runs
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: dropped(n).get("data", {}).get("malformed", 0) >= 2, 1.0)
    counters = dropped(n)
    assert counters.get("data", {}).get("malformed", 0) == 2, counters
    assert counters.get("mesh", {}).get("malformed", 0) == 1, counters
    assert "Traceback" not in n.log()


def test_invalid_utf8_at_a_runner_does_not_crash_it(env: Env, ctx: zmq.Context) -> None:
    """Was: the same frame crashed the runner (restarted by its supervisor)."""
    port = env.runner()["port"]
    _send(ctx, port, BAD_UTF8)
    assert not _restarted(env, port), "the runner crashed"


# -- fixed in d6b9637: meshd/engines/runner.py --------------------------------------------
def test_an_activation_sent_to_stage_0_does_not_crash_the_runner(
    env: Env, ctx: zmq.Context
) -> None:
    """Was: a runner crash (StageInputError out of step()). Anyone who could reach a
    runner (its port and the instance id are in GET /v1/cluster) took the model down with
    one message per restart; the 4th crash in 60 s made the supervisor give up."""
    t = env.target
    port = env.runner()["port"]
    sink = wire.Addr(node="x", addresses=["127.0.0.1"], port=9)
    act = wire.Activation(
        req="r", instance=t.instance, generation=t.generation, pos=0, rows=1, hidden=t.hidden,
        start=wire.Start(route=[sink], reply_to=sink, sampling=Sampling(), n_prompt=1),
    )  # fmt: skip
    _send(ctx, port, wire.encode(act), np.zeros((1, t.hidden), np.float32).tobytes())
    assert not _restarted(env, port), "the runner crashed"


# -- fixed in d6b9637: meshd/crdt/replica.py (duplicate-id check) -------------------------
def test_a_forged_entry_under_the_nodes_own_id_does_not_stop_it(
    cluster: Cluster, ctx: zmq.Context
) -> None:
    """Was: exit code 3. Node ids are public (Bonjour TXT, GET /v1/cluster): one Hello
    from any host on the LAN stopped any node."""
    n = cluster.start("v", extra_args=["--open"])
    clock = HLC()
    clock.observe(clock.now() + (1 << 16) * 1000)  # a second ahead: newer than the node's
    forged = Entry(health_key(n.node_id), clock.now(), n.node_id, encode(Health(seq=1)))
    hello = wire.Hello(sender="x", cluster=wire.cluster_hash(cluster.cluster_name),
                       incarnation="1", entries=[forged])  # fmt: skip
    _send(ctx, n.mesh_port, wire.encode(hello))
    assert not _gone(n), f"node exited with {n.proc.returncode}"


# -- fixed in d6b9637: meshd/transport/gossip.py + meshd/node/daemon.py (GC horizon) ----
def test_an_absurd_sync_clock_from_a_peer_cannot_push_the_gc_horizon(
    cluster: Cluster, ctx: zmq.Context
) -> None:
    """The fake peer reports ``synced`` = 2**62 in its heartbeat and answers a pull with
    ``hlc`` = 2**62. Was: the node's horizon jumped there, so it refused every new key
    from then on (no node could join it again, no instance could be placed)."""
    n = cluster.start("h", extra_args=["--open"])
    absurd = 1 << 62
    beat = Entry(health_key(FAKE_ID), HLC().now(), FAKE_ID, encode(Health(seq=1, synced=absurd)))
    topic, pub, mesh = pose_as_peer(cluster, n, ctx, extra=[beat])
    # A digest that differs from the node's: it pulls from us, we answer with the clock.
    pub.send_multipart(
        [topic, wire.encode(wire.Digest(sender=FAKE_ID, hlc=0, buckets=[1] * N_BUCKETS))]
    )
    assert mesh.poll(5000), "no pull came"
    ident = mesh.recv_multipart()[0]
    mesh.send_multipart([ident, wire.encode(wire.PullReply(sender=FAKE_ID, hlc=absurd,
                                                           entries=[]))])  # fmt: skip
    time.sleep(0.6)  # a few liveness ticks: the horizon is recomputed every 0.2 s
    # A newcomer greets the node with its card, stamped now.
    newcomer = "0123456789abcdef"
    card = NodeCard(
        id=newcomer, name="new", incarnation="1", cluster=cluster.cluster_name, version="0",
        os="linux", arch="x86_64", cpu_count=1, mem_total=1, mem_available=1,
        addresses=["127.0.0.1"], mesh_port=9, pub_port=9, api_port=9,
    )  # fmt: skip
    entry = Entry(node_key(newcomer), HLC().now(), newcomer, encode(card))
    _send(ctx, n.mesh_port, wire.encode(
        wire.Hello(sender=newcomer, cluster=topic, incarnation="1", entries=[entry])
    ))  # fmt: skip

    def joined() -> bool:
        return newcomer in {m["id"] for m in get(n, "/v1/cluster")["nodes"]}

    with contextlib.suppress(TimeoutError):
        wait_for(joined, 1.0)
    assert joined(), f"newcomer refused: {dropped(n).get('entries')}"


# -- fixed in d6b9637: meshd/engines/models.py + meshd/api/openai.py ----------------------
def test_a_model_name_longer_than_a_file_name_is_a_404(env: Env) -> None:
    """Was: a 500 on all three routes (OSError ENAMETOOLONG out of resolve_model)."""
    n = env.node
    body = {"model": "x" * 300, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    codes = {p: post(n, p, body).status_code
             for p in ("/v1/chat/completions", "/v1/completions", "/v1/instances")}  # fmt: skip
    assert codes == dict.fromkeys(codes, 404), codes


def test_a_model_path_to_a_broken_gguf_is_a_4xx(env: Env, tmp_path: Path) -> None:
    """Was: a 500 on the completion routes (POST /v1/instances said 400)."""
    n = env.node
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))  # no metadata at all
    body = {"model": str(bad), "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    codes = {p: post(n, p, body).status_code
             for p in ("/v1/chat/completions", "/v1/completions", "/v1/instances")}  # fmt: skip
    assert all(400 <= c < 500 for c in codes.values()), codes


# -- fixed in d6b9637: meshd/node/metrics.py + meshd/node/daemon.py -------------------------
def test_dropped_frames_show_in_metrics(env: Env, ctx: zmq.Context) -> None:
    """Was: meshd_dropped_frames declared in /metrics, never incremented."""
    n = env.node
    before = dropped(n).get("mesh", {}).get("malformed", 0)
    _send(ctx, n.mesh_port, b"\xc1")
    wait_for(lambda: dropped(n).get("mesh", {}).get("malformed", 0) > before, 5)
    text = client(n).get("/metrics").text
    samples = [ln for ln in text.splitlines() if ln.startswith("meshd_dropped_frames_total{")]
    assert any('reason="malformed"' in ln and 'socket="mesh"' in ln for ln in samples), samples


# -- meshd/api/server.py ---------------------------------------------------------------
def test_a_small_response_waits_for_no_delayed_ack(env: Env) -> None:
    """uvicorn writes a response's headers and body apart; without TCP_NODELAY, Nagle
    holds the body until the client acknowledges the headers, which Linux delays by
    ~40 ms: every JSON answer of the API took 40+ ms instead of ~1 ms."""
    with httpx.Client(base_url=env.node.api, timeout=10) as c:
        c.get("/healthz")  # connect (the first exchange is acknowledged at once)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            c.get("/healthz").raise_for_status()
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.02, [round(x * 1000, 1) for x in times]


# -- meshd/engines/runner.py (Runner.send) ---------------------------------------------
def test_a_flood_of_reply_addresses_does_not_exhaust_a_runner(
    cluster: Cluster, ctx: zmq.Context
) -> None:
    """1100 refused Generates, each naming another reply address: the runner opens a
    DEALER for each (redialling it every 100 ms, forever) and then cannot open one more,
    so it can answer no new API node (ZMQError "Too many open files", logged per frame)."""
    n = cluster.start("d", extra_args=["--open"])
    r = post(n, "/v1/instances", {"model": DEFAULT_MODEL, "nodes": ["d"]})
    assert r.status_code == 201, r.text

    def runner_port() -> int | None:
        rs = get(n, "/v1/cluster")["nodes"][0]["health"].get("runners", [])
        return rs[0]["port"] if rs and rs[0]["state"] == "ready" else None

    port = wait_for(runner_port, 60, interval=0.05)
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 1000)
    d.connect(f"tcp://127.0.0.1:{port}")
    for i in range(1100):  # loopback addresses nothing listens on (port 9: discard)
        nowhere = wire.Addr(node="x", addresses=[f"127.0.{i // 250 + 1}.{i % 250 + 2}"], port=9)
        g = wire.Generate(req=f"r{i}", instance="nope", generation=1, route=[nowhere],
                          reply_to=nowhere, job=Job(prompt="x"))  # fmt: skip
        d.send(wire.encode(g))
    sink = ctx.socket(zmq.ROUTER)
    sink_port = sink.bind_to_random_port("tcp://127.0.0.1")
    here = wire.Addr(node="x", addresses=["127.0.0.1"], port=sink_port)
    d.send(wire.encode(wire.Generate(req="last", instance="nope", generation=1, route=[here],
                                     reply_to=here, job=Job(prompt="x"))))  # fmt: skip
    assert sink.poll(3000), "the runner could not answer a new reply address"
    chunk = wire.decode_output(sink.recv_multipart()[1])
    assert isinstance(chunk, wire.DataChunk) and chunk.error is not None
    assert chunk.error.code == "wrong_stage"

"""Random frames at every socket of a real node: nothing crashes, nothing changes.

Each test throws hypothesis-generated multipart messages at one socket of node ``a``
(see frames.py for what is generated and harness.py for the checks), then checks:
the process is alive, ``/healthz`` answers, the replicated state is what it was,
the socket's drop counters grew by at least the number of frames that had to be
dropped, no loop caught an exception, no runner restarted, and a greedy completion
still returns the text it returned before any fuzzing.
"""

from __future__ import annotations

import collections
import time

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from meshd.crdt.lww import N_BUCKETS
from meshd.models.manifest import SLICE_FORMAT_VERSION
from meshd.transport import wire
from tests.cluster import wait_for

from .frames import Target, decoded, decoded_transfer, harmless, header, transfer_header
from .harness import FAKE_ID, FIGURES, Env, dropped, fuzz_settings, total

pytestmark = pytest.mark.timeout(90)


def _dealer(env: Env, port: int) -> zmq.Socket:
    d = env.ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVHWM, 0)
    d.connect(f"tcp://127.0.0.1:{port}")
    return d


def _drain(sock: zmq.Socket) -> list[list[bytes]]:
    out = []
    while sock.poll(0):
        out.append(sock.recv_multipart())
    return out


def _extras() -> st.SearchStrategy[list[bytes]]:
    return st.lists(st.binary(max_size=64), max_size=2)


def _alive(env: Env, last: collections.deque) -> None:
    if not env.node.alive():
        FIGURES.crashes += 1
        raise AssertionError(f"node died; last frames sent: {list(last)}\n{env.node.log()[-3000:]}")


def _screen(
    head: bytes, t: Target, socket: str, limit: int = wire.MAX_CONTROL_FRAME
) -> tuple[bool, wire.Message | None]:
    """Whether to send ``head`` on ``socket`` (see frames.harmless), and what it decodes to."""
    msg = decoded(head, socket, limit)
    ok = harmless(msg, t, socket)
    if not ok:
        FIGURES.skipped_frames += 1
    return ok, msg


def _wait_counted(env: Env, socket: str, before: int, expected: int) -> None:
    """Every frame that had to be dropped on ``socket`` was counted (lower bound)."""
    try:
        wait_for(lambda: total(dropped(env.node), socket) - before >= expected, 10)
    except TimeoutError:
        got = total(dropped(env.node), socket) - before
        msg = f"{socket}: {got} frames counted as dropped, >= {expected} due"
        raise AssertionError(msg) from None


# -- mesh ROUTER (Hello / Pull) ------------------------------------------------------
def _mesh_drop(msg: wire.Message | None, t: Target) -> bool:
    """Whether the mesh ROUTER must count this frame as dropped."""
    if isinstance(msg, wire.Hello):
        return msg.cluster != t.topic
    if isinstance(msg, wire.Pull):
        return len(msg.buckets) != N_BUCKETS
    return True


def test_mesh_router_survives_random_frames(env: Env) -> None:
    t, node = env.target, env.node
    mark = env.log_mark()
    before = dropped(node)
    d = _dealer(env, node.mesh_port)
    last: collections.deque = collections.deque(maxlen=8)
    due = {"mesh": 0, "entries": 0}

    @fuzz_settings(400)
    @given(head=header(t), extra=_extras())
    def one(head: bytes, extra: list[bytes]) -> None:
        ok, msg = _screen(head, t, "mesh")
        if not ok:
            return
        d.send_multipart([head, *extra])
        last.append([head, *extra])
        FIGURES.frame("mesh ROUTER")
        due["mesh"] += _mesh_drop(msg, t)
        if isinstance(msg, wire.Hello) and msg.cluster == t.topic:
            due["entries"] += len(msg.entries)
        _drain(d)
        _alive(env, last)

    try:
        one()
        # Over the control-plane limit: read, then dropped and counted.
        for _ in range(2):
            d.send(b"\x92" + b"\x00" * wire.MAX_CONTROL_FRAME)
            due["mesh"] += 1
        # Over ZMQ_MAXMSGSIZE: libzmq drops the connection before Python sees it.
        d.send(b"\x00" * (wire.ZMQ_MAX_MSG_SIZE + 1))
        FIGURES.frame("mesh ROUTER", 3)
        _wait_counted(env, "mesh", total(before, "mesh"), due["mesh"])
        if due["entries"]:
            assert total(dropped(node), "entries") > total(before, "entries")
        # The loop still answers a proper request.
        probe = _dealer(env, node.mesh_port)
        try:
            pull = wire.Pull(sender=f"probe-{time.monotonic_ns()}", buckets=[0] * N_BUCKETS)
            probe.send(wire.encode(pull))
            assert probe.poll(5000), "mesh ROUTER stopped answering"
            assert isinstance(wire.decode_gossip(probe.recv_multipart()[0]), wire.PullReply)
        finally:
            probe.close()
    finally:
        d.close()
    env.check(mark, "mesh ROUTER fuzzing")


# -- SUB (posing as the fake peer's PUB) ---------------------------------------------
@st.composite
def _gossip(draw, t: Target) -> tuple[list[bytes], str]:
    """A multipart message for our PUB, and its shape."""
    head = draw(header(t))
    shape = draw(st.sampled_from(["ok"] * 6 + ["alone", "extra", "long_topic", "other"]))
    if shape == "ok":
        return [t.topic, head], shape
    if shape == "alone":
        return [t.topic], shape
    if shape == "extra":
        return [t.topic, head, *draw(_extras()), b""], shape
    if shape == "long_topic":  # passes ZeroMQ's prefix filter, not the node's check
        return [t.topic + draw(st.binary(min_size=1, max_size=8)), head], shape
    # Another cluster's topic: ZeroMQ filters it out before the node sees it.
    other = draw(st.binary(min_size=8, max_size=8).filter(lambda b: b != t.topic))
    return [other, head], shape


def _gossip_drop(msg: wire.Message | None) -> bool:
    return not isinstance(msg, wire.Delta | wire.Digest)


def test_sub_survives_random_gossip_from_a_peer(env: Env) -> None:
    t, node = env.target, env.node
    mark = env.log_mark()
    before = dropped(node)
    last: collections.deque = collections.deque(maxlen=8)
    due = {"gossip": 0}

    @fuzz_settings(400)
    @given(item=_gossip(t))
    def one(item: tuple[list[bytes], str]) -> None:
        frames, shape = item
        msg = None
        if len(frames) >= 2:
            ok, msg = _screen(frames[1], t, "sub")
            if not ok:
                return
        drop = {"ok": _gossip_drop(msg), "other": False}.get(shape, True)
        env.pub.send_multipart(frames)
        last.append(frames)
        FIGURES.frame("SUB")
        due["gossip"] += drop
        if FIGURES.frames["SUB"] % 100 == 0:
            time.sleep(0.05)  # stay far below the SUB's high-water mark
        _alive(env, last)

    one()
    for _ in range(2):
        env.pub.send_multipart([t.topic, b"\x92" + b"\x00" * wire.MAX_CONTROL_FRAME])
        due["gossip"] += 1
    FIGURES.frame("SUB", 2)
    _wait_counted(env, "gossip", total(before, "gossip"), due["gossip"])
    # The loop still reads: one more garbage frame is counted.
    n = total(dropped(node), "gossip")
    env.pub.send_multipart([t.topic, b"\xc1"])
    wait_for(lambda: total(dropped(node), "gossip") > n, 5)
    env.check(mark, "SUB fuzzing")


# -- replies to the node's own requests (Hello / Pull to the fake peer) -------------
def test_requests_survive_random_replies_from_a_peer(env: Env) -> None:
    """Node a pulls from the fake peer when its digest differs; we answer with fuzz.

    The fake peer publishes no heartbeat (no ``synced``), so the absurd clocks of these
    replies cannot move node a's GC horizon here; test_regressions.py shows that they
    can when it does."""
    t, node = env.target, env.node
    mark = env.log_mark()
    before = dropped(node)
    last: collections.deque = collections.deque(maxlen=8)
    due = {"request": 0}
    _drain(env.fake_mesh)

    def next_request() -> bytes:
        """The identity of the next request node a sends the fake peer."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not env.fake_mesh.poll(0):
                # A digest that differs from a's: a pulls from us.
                dg = wire.Digest(sender=FAKE_ID, hlc=0, buckets=[1] * N_BUCKETS)
                env.pub.send_multipart([t.topic, wire.encode(dg)])
            if env.fake_mesh.poll(200):
                return env.fake_mesh.recv_multipart()[0]
        raise AssertionError("node a sent the fake peer no request")

    @fuzz_settings(150)
    @given(head=header(t), extra=_extras(), multi=st.booleans())
    def one(head: bytes, extra: list[bytes], multi: bool) -> None:
        ok, msg = _screen(head, t, "reply")
        if not ok:
            return
        frames = [head, *extra] if multi and extra else [head]
        ident = next_request()
        env.fake_mesh.send_multipart([ident, *frames])
        last.append(frames)
        FIGURES.frame("request DEALER")
        due["request"] += len(frames) != 1 or msg is None
        _alive(env, last)

    one()
    _wait_counted(env, "request", total(before, "request"), due["request"])
    env.check(mark, "fuzzed replies")


# -- the API node's data-plane ROUTER (DataChunks) -----------------------------------
def test_data_router_survives_random_frames(env: Env) -> None:
    t, node = env.target, env.node
    mark = env.log_mark()
    before = dropped(node)
    port = node.get("/healthz")["data_port"]
    d = _dealer(env, port)
    last: collections.deque = collections.deque(maxlen=8)
    due = {"data": 0}

    @fuzz_settings(300)
    @given(head=header(t), extra=_extras())
    def one(head: bytes, extra: list[bytes]) -> None:
        # Nothing is in flight: every frame is dropped (shape, malformed, unexpected,
        # unknown_request) and counted.
        if not _screen(head, t, "data")[0]:
            return
        d.send_multipart([head, *extra])
        last.append([head, *extra])
        FIGURES.frame("data ROUTER")
        due["data"] += 1
        _alive(env, last)

    try:
        one()
        d.send(b"\x92" + b"\x00" * wire.MAX_CONTROL_FRAME)
        d.send(b"\x00" * (wire.ZMQ_MAX_MSG_SIZE + 1))
        due["data"] += 1
        FIGURES.frame("data ROUTER", 2)
        _wait_counted(env, "data", total(before, "data"), due["data"])
        assert dropped(node)["data"].get("unknown_request", 0) > 0
    finally:
        d.close()
    env.check(mark, "data ROUTER fuzzing")


# -- the weights ROUTER (slices of the models this node holds) -----------------------
def test_weights_router_survives_random_frames(env: Env) -> None:
    t, node = env.target, env.node
    mark = env.log_mark()
    before = dropped(node)
    card = next(n["card"] for n in node.cluster()["nodes"] if n["id"] == node.node_id)
    d = _dealer(env, card["weights_port"])
    last: collections.deque = collections.deque(maxlen=8)
    due = {"weights": 0, "answered": 0}

    @fuzz_settings(300)
    @given(head=transfer_header(t), extra=_extras())
    def one(head: bytes, extra: list[bytes]) -> None:
        msg = decoded_transfer(head)
        d.send_multipart([head, *extra])
        last.append([head, *extra])
        FIGURES.frame("weights ROUTER")
        # A frame that is not one decodable message, or one a holder never receives,
        # is dropped and counted; an ask about what this node does not hold is refused.
        if extra or msg is None or not isinstance(msg, wire.SliceAsk | wire.ChunkAsk):
            due["weights"] += 1
        elif isinstance(msg, wire.ChunkAsk) or msg.version == SLICE_FORMAT_VERSION:
            due["answered"] += 1
        _alive(env, last)

    try:
        one()
        _wait_counted(env, "weights", total(before, "weights"), due["weights"])
        # Every refusal is typed: nothing was served, no chunk of any file.
        replies = []
        deadline = time.monotonic() + 10
        while len(replies) < due["answered"] and time.monotonic() < deadline:
            replies += _drain(d)
            time.sleep(0.05)
        kinds = {type(wire.decode_transfer(r[0])).__name__ for r in replies}
        assert kinds <= {"SliceRefusal"}, kinds
    finally:
        d.close()
    assert dropped(node).get("weights", {}).get("error", 0) == 0
    env.check(mark, "weights ROUTER fuzzing")


# -- a runner's stage ROUTER (Generate / Activation / Token / Release) ---------------
def _addrs(msg: wire.Message) -> list[wire.Addr]:
    out: list[wire.Addr] = []
    for name in ("route", "reply_to"):
        v = getattr(msg, name, None)
        out += v if isinstance(v, list) else [v] if v is not None else []
    start = getattr(msg, "start", None)
    if start is not None:
        out += [*start.route, start.reply_to]
    return out


def _dialable(msg: wire.Message, t: Target) -> bool:
    """Whether every address the runner may dial for ``msg`` is our sink.

    A mutated address makes the runner dial whatever it names, for good: a host name
    (a DNS stall on a box without network), a port of node a's (ZMTP bytes at its
    HTTP server), a port out of range (ZMQError and a traceback). The runner keeps
    every such DEALER forever (see the report on runner robustness)."""
    for a in _addrs(msg):
        if a.port != t.sink.port or any(h != "127.0.0.1" for h in a.addresses):  # type: ignore[union-attr]
            return False
    return True


@st.composite
def _stage_message(draw, t: Target) -> list[bytes]:
    """Header plus raw frames; Activations get a tensor of the declared shape at times."""
    head = draw(header(t))
    msg = decoded(head, "runner", wire.MAX_DATA_FRAME)
    if isinstance(msg, wire.Activation) and draw(st.booleans()):
        rows, hidden = draw(st.integers(1, 3)), t.hidden
        msg = msgspec.structs.replace(msg, rows=rows, hidden=hidden, dtype="f32")
        values = draw(st.sampled_from([0.0, 1.0, float("nan"), float("inf"), -1e38]))
        tensor = np.full((rows, hidden), values, np.float32).tobytes()
        return [wire.encode(msg), tensor]
    return [head, *draw(st.lists(st.binary(max_size=256), max_size=2))]


def _refusal_due(msg: wire.Message | None, t: Target) -> bool:
    """Whether the runner must answer ``msg`` with a typed error at our sink: a Generate
    for another instance (``wrong_stage``) or another plan (``generation_mismatch``).
    (An Activation for another plan may be answered too; stage 0 may also just drop it.)"""
    return isinstance(msg, wire.Generate) and msg.reply_to.port == t.sink.port  # type: ignore[union-attr]


def test_runner_survives_random_frames(env: Env) -> None:
    t = env.target
    mark = env.log_mark()
    runner = env.runner()
    d = _dealer(env, runner["port"])
    _drain(env.sink)
    last: collections.deque = collections.deque(maxlen=8)
    due = {"refusals": 0}

    @fuzz_settings(300)
    @given(frames=_stage_message(t))
    def one(frames: list[bytes]) -> None:
        ok, msg = _screen(frames[0], t, "runner", wire.MAX_DATA_FRAME)
        if not ok:
            return
        if msg is not None and not _dialable(msg, t):
            FIGURES.skipped_frames += 1
            return
        d.send_multipart(frames)
        last.append(frames)
        FIGURES.frame("runner ROUTER")
        due["refusals"] += _refusal_due(msg, t)
        _alive(env, last)

    # Every request for another plan or another instance gets its typed refusal.
    codes: collections.Counter[str] = collections.Counter()

    def refusals() -> bool:
        for _ident, head, *_ in _drain(env.sink):
            chunks = wire.chunks_in(wire.decode_output(head))  # a batch when several came at once
            assert chunks, head
            for chunk in chunks:
                assert chunk.error is not None, chunk
                codes[chunk.error.code] += 1
        return sum(codes.values()) >= due["refusals"]

    try:
        one()
        d.send(b"\x00" * (wire.MAX_DATA_FRAME + 1))  # libzmq drops the connection
        FIGURES.frame("runner ROUTER")
        wait_for(refusals, 10)
    finally:
        d.close()
    assert set(codes) <= {"wrong_stage", "generation_mismatch"}, codes
    after = env.runner()
    assert after["port"] == runner["port"], "the runner was restarted"
    env.check(mark, "runner ROUTER fuzzing")

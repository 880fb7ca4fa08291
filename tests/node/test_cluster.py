"""Several real `meshd up` processes on loopback: convergence, death, rejoin, leave."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

from meshd.crdt.hlc import HLC, pack, wall_ms
from meshd.crdt.lww import Entry
from meshd.crdt.views import NodeCard, encode, node_key
from meshd.node.daemon import EXIT_ID_CLASH
from meshd.node.identity import ID_FILE, fingerprint
from meshd.transport import wire
from tests.cluster import Cluster, NodeProc, wait_for

pytestmark = pytest.mark.timeout(90)


def _view(n: NodeProc) -> dict[str, tuple[str, str]]:
    """Node id -> (name, incarnation) as ``n`` sees the cluster."""
    return {m["id"]: (m["name"], m["card"]["incarnation"]) for m in n.cluster()["nodes"]}


def _three(cluster: Cluster) -> list[NodeProc]:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a], wait=False)
    c = cluster.start("c", peers=[a], wait=False)
    cluster.wait_ready(b)
    cluster.wait_ready(c)
    return [a, b, c]


def _all_agree(nodes: list[NodeProc]) -> bool:
    views = [_view(n) for n in nodes]
    ids = {n.node_id for n in nodes}
    if any(set(v) != ids for v in views) or any(v != views[0] for v in views):
        return False
    return all(set(n.liveness().values()) == {"alive"} for n in nodes)


def _digests(nodes: list[NodeProc]) -> set[str]:
    """Each node's replica root hash (``/healthz`` ``digest``)."""
    return {n.get("/healthz")["digest"] for n in nodes}


def _same_state(nodes: list[NodeProc]) -> bool:
    """Every node holds the same entries (heartbeats included: polled until a moment
    when none is in flight)."""
    return len(_digests(nodes)) == 1


def _beat(n: NodeProc) -> tuple[str, int]:
    """``n``'s incarnation and the number of its latest heartbeat (as it sees itself)."""
    me = next(m for m in n.cluster()["nodes"] if m["id"] == n.node_id)
    return me["card"]["incarnation"], me["health"]["seq"]


@dataclass
class Three:
    """Three nodes (b and c seeded with a only) shared by the tests that leave them as
    they found them: three alive nodes that agree (one stopped is started again)."""

    cluster: Cluster
    nodes: list[NodeProc]
    #: Seconds from the three being up to their agreeing on who is in the cluster,
    #: each alive (their whole states then agree within seconds too).
    converged_s: float
    #: (incarnation, heartbeat number) of each node when they first agreed.
    agreed_beats: list[tuple[str, int]]


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Three]:
    with Cluster(tmp_path_factory.mktemp("three")) as cluster:
        nodes = _three(cluster)
        t0 = time.monotonic()
        agreed_at: list[float] = []

        def agreed() -> bool:
            # Timed from when the look began: its six HTTP reads take a while on a busy
            # machine (another test's nodes beside these), which is not the gossip's time.
            began = time.monotonic()
            ok = _all_agree(nodes)
            if ok:
                agreed_at.append(began)
            return ok

        wait_for(agreed, timeout=10.0)
        # The same entries too, heartbeats included: not timed, since three digests read
        # one after another match only between heartbeats, a window a busy machine
        # narrows (a run on four workers measured 3.6 s that way).
        wait_for(lambda: _same_state(nodes), timeout=10.0)
        yield Three(cluster, nodes, agreed_at[0] - t0, [_beat(n) for n in nodes])


def test_three_nodes_with_static_peers_converge_within_2s(three: Three) -> None:
    # Timed as the fixture started them, before any test changed them.
    assert three.converged_s < 2.0
    # c only knows a; it must have learned b (and b, c) through gossip.
    c_view = _view(three.nodes[2])
    assert three.nodes[1].node_id in c_view


def test_second_process_on_same_data_dir_is_refused(three: Three) -> None:
    a = three.nodes[0]
    r = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshd", "up", "--no-discovery",
         "--api-port", "0", "--mesh-port", "0", "--data-dir", str(a.data_dir)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode != 0
    assert "another meshd process" in r.stderr
    assert a.alive() and _all_agree(three.nodes)


_ERROR_LINE = re.compile(r"^\S+ E ", re.MULTILINE)


def test_a_healthy_cluster_refuses_no_own_entries_and_logs_no_error(three: Three) -> None:
    """Echoes of a node's own older heartbeats (in Welcomes and pull replies) are no
    clash. Was: counted as own_id and logged as 'another process uses this id'."""
    nodes = three.nodes
    wait_for(lambda: _all_agree(nodes), timeout=5.0)

    def beats_since_agreed(n: NodeProc, i: int) -> int:
        inc, seq = _beat(n)
        then_inc, then_seq = three.agreed_beats[i]
        return seq - (then_seq if inc == then_inc else 0)

    # Eight heartbeats (4 s) of each since they agreed, whatever ran here since: several
    # digest rounds and the first pulls, whose replies carry each node's own older beats.
    wait_for(lambda: all(beats_since_agreed(n, i) >= 8 for i, n in enumerate(nodes)), 15.0)
    for n in nodes:
        assert n.get("/healthz")["dropped"].get("entries", {}).get("own_id", 0) == 0, n.name
        assert not _ERROR_LINE.search(n.log()), n.log()


@pytest.mark.parametrize("mode", ["secured", "open"])
def test_node_of_another_cluster_is_refused(
    three: Three, cluster: Cluster, tmp_path, mode: str
) -> None:
    extra = ["--open"] if mode == "open" else []
    # A secured node: one of the three (turning a stranger away changes nothing there);
    # an open one is started for the test.
    a = three.nodes[0] if mode == "secured" else cluster.start("a", extra_args=extra)
    members = set(a.liveness())
    other = Cluster(tmp_path / "other", cluster="other")
    try:
        x = other.start("x", peers=[a], extra_args=extra)

        def refused() -> int:
            dropped = a.get("/healthz")["dropped"]
            if mode == "open":
                return dropped.get("mesh", {}).get("wrong_cluster", 0)
            # Another cluster key: turned away at the door (its proof is no proof).
            return dropped.get("join", {}).get("bad_proof", 0)

        # Looked at once a has turned x's greeting away: the only way in x has.
        wait_for(refused, timeout=10.0)
        assert set(a.liveness()) == members
        assert set(x.liveness()) == {"x"}
    finally:
        other.close()


def test_second_live_process_with_the_same_id_gives_way_with_exit_code_3(
    three: Three, tmp_path
) -> None:
    """A cloned VM: same machine id, data dir copied to the same path. The process that
    started later exits with EXIT_ID_CLASH, naming the other; the first keeps its id.
    Was: both re-stamped their cards forever."""
    s, a, _ = three.nodes  # the clone's seed, and the node it is a copy of
    wait_for(lambda: _all_agree(three.nodes), timeout=5.0)
    inc = _view(s)[a.node_id][1]
    clone = tmp_path / "clone"
    shutil.copytree(a.data_dir, clone, ignore=shutil.ignore_patterns("meshd.lock"))
    # What the clone's disk holds on a cloned VM: a's id under a fingerprint that matches.
    (clone / ID_FILE).write_text(
        json.dumps({"node_id": a.node_id, "fingerprint": fingerprint(clone)})
    )
    b = three.cluster.start("clone", peers=[s], data_dir=clone)
    assert b.node_id == a.node_id
    assert b.proc.wait(15) == EXIT_ID_CLASH, b.log()
    assert f"127.0.0.1:{a.mesh_port}" in b.log() and "started first" in b.log()
    assert a.alive()
    # The cluster ends with the first process's card (and no "left" for the shared id).
    wait_for(lambda: _view(s)[a.node_id][1] == inc and _all_agree(three.nodes), timeout=5.0)


def test_sigkilled_node_is_dead_within_3s_and_rejoins_under_same_id(three: Three) -> None:
    a, b, c = three.nodes
    wait_for(lambda: _all_agree([a, b, c]), timeout=5.0)
    old_id, old_inc = c.node_id, _view(a)[c.node_id][1]
    c.kill()
    t0 = time.monotonic()
    wait_for(lambda: a.liveness()["c"] == "dead" and b.liveness()["c"] == "dead", timeout=3.0)
    assert time.monotonic() - t0 < 3.0

    c2 = three.nodes[2] = three.cluster.restart(c)
    assert c2.node_id == old_id
    wait_for(lambda: _all_agree([a, b, c2]), timeout=5.0)
    # Same id, new incarnation: the cluster saw a restart, not a stranger.
    assert _view(b)[old_id][1] != old_inc
    assert len(a.cluster()["nodes"]) == 3


def test_clean_stop_is_seen_as_left_without_waiting_for_the_timeout(three: Three) -> None:
    a, b, c = three.nodes
    wait_for(lambda: _all_agree([a, b, c]), timeout=5.0)
    assert b.terminate() == 0
    t0 = time.monotonic()
    wait_for(lambda: a.liveness()["b"] == "left" and c.liveness()["b"] == "left", timeout=1.0)
    # Well under the 2 s a silent death takes to be declared.
    assert time.monotonic() - t0 < 1.0
    # Back as the next test expects the three (and a node that left may come back).
    b2 = three.nodes[1] = three.cluster.restart(b)
    wait_for(lambda: _all_agree([a, b2, c]), timeout=5.0)


def test_copied_data_dir_gets_a_new_id_not_a_duplicate(cluster: Cluster, tmp_path) -> None:
    a = cluster.start("a")
    copy = tmp_path / "copied"
    shutil.copytree(a.data_dir, copy, ignore=shutil.ignore_patterns("meshd.lock"))
    b = cluster.start("b", peers=[a], data_dir=copy)
    assert b.node_id != a.node_id
    wait_for(lambda: _all_agree([a, b]), timeout=3.0)


def _free_port() -> int:
    """A free mesh port whose neighbour (the join desk's port) is free too: a taken
    neighbour moves the join desk elsewhere, which these tests do not expect."""
    for _ in range(50):
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                t.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free pair of ports")


def test_a_node_that_ran_alone_past_the_grace_sees_its_seed(cluster: Cluster) -> None:
    """b is started with a seed that is not up yet and runs alone past the tombstone
    grace, so its card is older than any horizon a lone node would set. Was: each
    refused the other's card (below_horizon) and they never met."""
    port = _free_port()
    grace = ["--tombstone-grace", "1000"]
    b = cluster.start("b", extra_args=["--peer", f"127.0.0.1:{port}", *grace])
    time.sleep(2.5)
    # a runs alone until b's next hello (every 2 s) reaches it: no wait here makes that
    # longer, the look below only begins sooner.
    a = cluster.start("a", mesh_port=port, extra_args=grace)
    wait_for(lambda: _all_agree([a, b]) and _same_state([a, b]), timeout=7.5)
    for n in (a, b):
        assert n.get("/healthz")["dropped"].get("entries", {}).get("below_horizon", 0) == 0


def test_a_dead_node_is_forgotten_gc_resumes_and_it_can_come_back(cluster: Cluster) -> None:
    """Was: a SIGKILLed node stayed 'dead' forever and its frozen sync clock stopped
    tombstone collection everywhere."""
    args = ["--forget-after", "2", "--tombstone-grace", "300"]
    a = cluster.start("a", extra_args=args)
    b = cluster.start("b", peers=[a], extra_args=args, wait=False)
    c = cluster.start("c", peers=[a], extra_args=args, wait=False)
    cluster.wait_ready(b)
    cluster.wait_ready(c)
    wait_for(lambda: _all_agree([a, b, c]), timeout=5.0)
    c.kill()

    def forgotten_and_collected() -> bool:
        # Only a's and b's card and heartbeat are left (and the three member entries:
        # a silent member is forgotten, not removed): c's tombstones were collected,
        # which needs a horizon that c's frozen clock no longer holds back.
        return all(
            set(_view(n)) == {a.node_id, b.node_id} and n.get("/healthz")["entries"] == 4 + 3
            for n in (a, b)
        )

    wait_for(forgotten_and_collected, timeout=15.0)
    assert "forgetting node c" in a.log() + b.log()
    c2 = cluster.restart(c)
    wait_for(lambda: _all_agree([a, b, c2]) and _same_state([a, b, c2]), timeout=10.0)


def test_an_entry_stamped_past_max_clock_drift_is_refused(cluster: Cluster) -> None:
    """``--max-clock-drift 2000``: a card stamped 10 s ahead is refused (under the 60 s
    default it would be taken), a card stamped now is taken."""
    # --open: the test writes the hello by hand (a secured node admits members only).
    n = cluster.start("a", extra_args=["--max-clock-drift", "2000", "--open"])

    def card(nid: str, hlc: int) -> Entry:
        c = NodeCard(
            id=nid, name=nid, incarnation="1", cluster=cluster.cluster_name, version="0",
            os="linux", arch="x86_64", cpu_count=1, mem_total=1, mem_available=1,
            addresses=["127.0.0.1"], mesh_port=9, pub_port=9, api_port=9,
        )  # fmt: skip
        return Entry(node_key(nid), hlc, nid, encode(c))

    now, ahead = "1111111111111111", "2222222222222222"
    entries = [card(now, HLC().now()), card(ahead, pack(wall_ms() + 10_000, 0))]
    hello = wire.Hello(sender=now, cluster=wire.cluster_hash(cluster.cluster_name),
                       incarnation="1", entries=entries)  # fmt: skip
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    try:
        d.connect(f"tcp://127.0.0.1:{n.mesh_port}")
        d.send(wire.encode(hello))
        assert d.poll(5000), "no Welcome"
        assert isinstance(wire.decode_gossip(d.recv_multipart()[0]), wire.Welcome)
    finally:
        d.close()
        ctx.term()
    ids = {m["id"] for m in n.cluster()["nodes"]}
    assert now in ids and ahead not in ids
    assert n.get("/healthz")["dropped"]["entries"]["clock_drift"] == 1


def test_a_seed_that_is_this_node_itself_is_not_taken_for_a_peer(cluster: Cluster) -> None:
    """One config on every machine often names this machine as a seed too."""
    port = _free_port()
    a = cluster.start("a", mesh_port=port, extra_args=["--peer", f"127.0.0.1:{port}"])
    time.sleep(4.5)  # a few hello rounds
    assert a.log().count("reaches this node itself") == 1, a.log()
    assert set(a.liveness()) == {"a"}
    assert not a.get("/healthz")["dropped"].get("entries")

"""``meshctl doctor``: the pure rules over handmade snapshots, then real nodes.

The rules (``meshd.node.diagnosis.diagnose``) are pinned one finding at a time, each
from the facts that make it, and a healthy snapshot gives nothing. The real runs start
`meshd up` processes: a healthy pair on loopback, a node with another cluster's secret
knocking at a member, a second process with a member's id; and, in network namespaces
with Bonjour on, a node of another cluster on the LAN and a member whose ports a
firewall rule drops.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from rich.console import Console

from meshd.cli.doctor import exit_code, render
from meshd.crdt.views import Health, Instance, InstanceSpec, NodeCard, RunnerStatus, Stage
from meshd.domain.facts import ModelFacts
from meshd.node.cluster import CRASH_LOOP, ClusterView
from meshd.node.diagnosis import (
    BONJOUR_SETTLE_S,
    DISK_ERROR_BYTES,
    Interface,
    PortCheck,
    Refusal,
    Report,
    Sighting,
    Snapshot,
    TwinSeen,
    Waiting,
    diagnose,
)
from meshd.node.identity import ID_FILE, fingerprint
from meshd.transport import wire
from meshd.transport.identity import curve_public_of
from meshd.transport.security import CurveKeys, secure, write_secret
from tests.cluster import Cluster, NodeProc, wait_for
from tests.netns import Host, Netns, require_netns
from tests.node.hand import HandMember

GiB = 1 << 30
VERSION = "0.1.0"
FACTS = ModelFacts(
    name="m",
    sha256="ab" * 32,
    n_layers=8,
    hidden_size=64,
    n_ctx_train=2048,
    layer_bytes=[512 << 20] * 8,
    embed_bytes=8 << 20,
    head_bytes=8 << 20,
    kv_bytes_per_token_layer=256,
    quant_types=["F32"],
    engines=["llama_cpp"],
)


# -- handmade snapshots -----------------------------------------------------------------


def _card(nid: str, *, version: str = VERSION, mem: int = 8 * GiB) -> NodeCard:
    return NodeCard(
        id=nid,
        name=f"n-{nid}",
        incarnation="i",
        cluster="home",
        version=version,
        os="linux",
        arch="x86_64",
        cpu_count=2,
        mem_total=mem,
        mem_available=mem,
        backends=["llama_cpp-cpu"],
        addresses=[f"192.168.1.{ord(nid[0])}"],
        mesh_port=7471,
        pub_port=40000,
        api_port=7470,
        data_port=40001,
        models=["m"],
    )


def _view(
    cards: list[NodeCard],
    *,
    liveness: dict[str, str] | None = None,
    ages: dict[str, float] | None = None,
    healths: dict[str, Health] | None = None,
    instances: list[Instance] = (),  # type: ignore[assignment]
) -> ClusterView:
    live = {c.id: "alive" for c in cards}
    live.update(liveness or {})
    return ClusterView(
        self_id="a",
        cards={c.id: c for c in cards},
        healths=healths or {c.id: Health(seq=1) for c in cards},
        instances={i.id: i for i in instances},
        liveness=live,  # type: ignore[arg-type]
        ages={c.id: 0.2 for c in cards} | (ages or {}),
    )


def _ok_ports(*nodes: str) -> tuple[PortCheck, ...]:
    return tuple(
        PortCheck(node=n, port_name=name, host=f"192.168.1.{ord(n[0])}", port=port, outcome="ok")
        for n in nodes
        for name, port in (("mesh", 7471), ("pub", 40000), ("data", 40001))
    )


def _healthy(**changes: Any) -> Snapshot:
    """Two live members that answer on every port, seen on Bonjour, clocks in step."""
    base: dict[str, Any] = {
        "view": _view([_card("a"), _card("b")]),
        "name": "n-a",
        "version": VERSION,
        "cluster": "home",
        "discovery_s": 60.0,
        "bonjour_peers": frozenset({"b"}),
        "sightings": (
            Sighting(
                node_id="b",
                name="n-b",
                host="192.168.1.98",
                port=7471,
                cluster="c0",
                cluster_name="home",
                version=VERSION,
                same_cluster=True,
                age_s=50,
            ),
        ),
        "ports": _ok_ports("b"),
        "probe_timeout_s": 1.5,
        "clock_ahead_ms": {"b": 3},
        "interfaces": (Interface("lo", "127.0.0.1", 8), Interface("eth0", "192.168.1.97", 24)),
        "advertised": ("192.168.1.97",),
        "dialled": {"b": "192.168.1.98"},
        "disk_path": "/data/cache",
        "disk_free": 100 * GiB,
    }
    base.update(changes)
    return Snapshot(**base)


def _codes(r: Report) -> dict[str, str]:
    return {f.code: f.severity for f in r.findings}


def _one(r: Report, code: str):
    hits = [f for f in r.findings if f.code == code]
    assert len(hits) == 1, r.findings
    return hits[0]


def test_a_healthy_snapshot_has_no_finding_and_says_what_it_checked() -> None:
    r = diagnose(_healthy())
    assert r.findings == []
    names = {c.name for c in r.checked}
    assert {
        "bonjour",
        "join desk",
        "ports",
        "liveness",
        "node id",
        "clock",
        "versions",
        "interfaces",
        "instances",
        "disk",
    } <= names


def test_a_node_of_another_cluster_on_bonjour_is_named_with_the_flag_to_fix_it() -> None:
    stranger = Sighting(
        node_id="x1",
        name="attic",
        host="192.168.1.50",
        port=7471,
        cluster="ff",
        cluster_name="lab",
        version=VERSION,
        same_cluster=False,
    )
    f = _one(diagnose(_healthy(sightings=(stranger,))), "other_cluster")
    assert f.severity == "warning"
    assert "'attic'" in f.what and "192.168.1.50:7471" in f.what and "'lab'" in f.what
    assert "--cluster home" in f.fix and "meshctl approve CODE" in f.fix
    # Same name, another key: two clusters started apart.
    twin_name = Sighting(
        node_id="x1",
        name="attic",
        host="192.168.1.50",
        port=7471,
        cluster="ff",
        cluster_name="home",
        version=VERSION,
        same_cluster=False,
    )
    f = _one(diagnose(_healthy(sightings=(twin_name,))), "other_cluster")
    assert "another key" in f.what and "cluster.key" in f.fix
    # Gone from Bonjour: nothing to say any more.
    gone = Sighting(
        node_id="x1",
        name="attic",
        host="h",
        port=1,
        cluster="ff",
        cluster_name="lab",
        version=VERSION,
        same_cluster=False,
        present=False,
    )
    assert "other_cluster" not in _codes(diagnose(_healthy(sightings=(gone,))))


def test_another_meshd_version_is_named_on_bonjour_and_among_members() -> None:
    old = Sighting(
        node_id="x1",
        name="old",
        host="192.168.1.9",
        port=7471,
        cluster="c0",
        cluster_name="home",
        version="0.0.9",
        same_cluster=True,
        age_s=1,
    )
    f = _one(diagnose(_healthy(sightings=(old,))), "other_version")
    assert "0.0.9" in f.what and "'old'" in f.what
    r = diagnose(_healthy(view=_view([_card("a"), _card("b", version="0.2.0")])))
    assert "0.2.0" in _one(r, "other_version").what


def test_a_peer_on_bonjour_that_never_reached_the_view_is_named() -> None:
    lost = Sighting(
        node_id="q",
        name="quiet",
        host="192.168.1.7",
        port=7471,
        cluster="c0",
        cluster_name="home",
        version=VERSION,
        same_cluster=True,
        age_s=30,
    )
    f = _one(diagnose(_healthy(sightings=(lost,))), "not_in_view")
    assert "192.168.1.7:7471" in f.what and "7471" in f.fix
    fresh = Sighting(
        node_id="q",
        name="quiet",
        host="h",
        port=7471,
        cluster="c0",
        cluster_name="home",
        version=VERSION,
        same_cluster=True,
        age_s=1,
    )
    assert "not_in_view" not in _codes(diagnose(_healthy(sightings=(fresh,))))


def test_refused_joins_and_zap_denials_are_counted_with_their_address() -> None:
    r = diagnose(
        _healthy(
            refusals=(
                Refusal(
                    address="10.0.0.9",
                    reason="bad_proof",
                    name="intruder",
                    node_id="x9",
                    count=3,
                    age_s=4,
                ),
                Refusal(address="10.0.0.8", reason="zap_denied", count=2, age_s=2),
                Refusal(address="10.0.0.7", reason="wrong_code", name="guest", count=1),
            )
        )
    )
    joins = [f for f in r.findings if f.code == "join_refused"]
    bad = next(f for f in joins if "10.0.0.9" in f.what)
    assert bad.severity == "error" and "3 times" in bad.what and "'intruder'" in bad.what
    assert "another cluster's secret" in bad.what and "meshctl approve CODE" in bad.fix
    assert next(f for f in joins if "10.0.0.7" in f.what).severity == "warning"
    zap = _one(r, "zap_refused")
    assert zap.severity == "error" and "10.0.0.8" in zap.what and "2 times" in zap.what
    assert r.findings[0].severity == "error"  # worst first


def test_a_node_waiting_for_approval_gets_the_approve_command() -> None:
    w = Waiting(node_id="x2", name="laptop", address="192.168.1.30", waiting_s=42)
    f = _one(diagnose(_healthy(waiting=(w,))), "waiting_approval")
    assert f.severity == "warning" and "192.168.1.30" in f.what and "42 s" in f.what
    assert f.fix.startswith("meshctl approve CODE")


def test_old_refusals_fade_a_stale_zap_denial_goes() -> None:
    old = Refusal(address="10.0.0.9", reason="bad_proof", name="x", count=1, age_s=3600)
    assert _one(diagnose(_healthy(refusals=(old,))), "join_refused").severity == "info"
    # A new member's first dial can beat its member entry here: a denial that did not
    # come back is no stranger.
    race = Refusal(address="10.0.0.8", reason="zap_denied", count=1, age_s=120)
    assert diagnose(_healthy(refusals=(race,))).findings == []


def test_failed_handshakes_are_a_warning_without_an_address() -> None:
    f = _one(diagnose(_healthy(handshake_failures={"mesh": 2, "pub": 1})), "handshake_failed")
    assert f.severity == "warning" and "3 connections" in f.what and "mesh, pub" in f.what
    # An open cluster has no keys: no desk, no handshakes to judge.
    assert diagnose(_healthy(secured=False)).findings == []


def test_a_live_member_whose_ports_do_not_answer_is_an_error_with_the_ports() -> None:
    ports = (
        PortCheck(node="b", port_name="mesh", host="192.168.1.98", port=7471, outcome="no_answer"),
        PortCheck(node="b", port_name="pub", host="192.168.1.98", port=40000, outcome="ok"),
        PortCheck(node="b", port_name="data", host="192.168.1.98", port=40001, outcome="no_answer"),
    )
    f = _one(diagnose(_healthy(ports=ports)), "ports_closed")
    assert f.severity == "error"
    assert "'n-b'" in f.what and "mesh 7471, data 40001 do not answer" in f.what
    assert "192.168.1.98" in f.what and "7471, 40001" in f.fix
    hs = (PortCheck(node="b", port_name="mesh", host="h", port=7471, outcome="handshake_failed"),)
    assert "handshake fails" in _one(diagnose(_healthy(ports=hs)), "ports_closed").what


def test_a_dead_member_is_named_with_how_long_it_is_silent() -> None:
    v = _view([_card("a"), _card("b")], liveness={"b": "dead"}, ages={"b": 75.0})
    bad = (PortCheck(node="b", port_name="pub", host="h", port=40000, outcome="no_answer"),)
    f = _one(diagnose(_healthy(view=v, ports=bad)), "peer_dead")
    assert f.severity == "warning" and "75 s" in f.what and "pub 40000" in f.what
    assert "ports_closed" not in _codes(diagnose(_healthy(view=v, ports=bad)))


def test_another_process_with_this_id_is_an_error_naming_it() -> None:
    t = TwinSeen(name="clone", address="192.168.1.77:7471", age_s=5, confirmed=True)
    f = _one(diagnose(_healthy(twins=(t,))), "duplicate_id")
    assert f.severity == "error" and "'clone' at 192.168.1.77:7471" in f.what
    assert "identity.json" in f.fix and "machine-id" in f.fix
    r = diagnose(_healthy(own_id_refused=4))
    assert _one(r, "own_id_refused").severity == "warning"
    assert "own_id_refused" not in _codes(diagnose(_healthy(twins=(t,), own_id_refused=4)))
    # A claim that was never proven is a warning, not the error that stops a node.
    claim = TwinSeen(name="x", address="10.0.0.9:7471", age_s=1, confirmed=False)
    r = diagnose(_healthy(twins=(claim,)))
    assert _one(r, "unproven_twin").severity == "warning" and "duplicate_id" not in _codes(r)


def test_clock_skew_is_named_against_the_drift_bound() -> None:
    assert diagnose(_healthy(clock_ahead_ms={"b": 1500})).findings == []
    f = _one(diagnose(_healthy(clock_ahead_ms={"b": 20_000})), "clock_skew")
    assert f.severity == "warning" and "'n-b'" in f.what and "20 s ahead" in f.what
    f = _one(diagnose(_healthy(clock_ahead_ms={"b": 61_000})), "clock_drift")
    assert f.severity == "error" and "over the 60 s bound" in f.what
    f = _one(diagnose(_healthy(clock_drift_refused=7)), "clock_drift")
    assert "7 entries refused" in f.what and "--max-clock-drift" in f.fix


def test_no_bonjour_peer_while_seeds_answer_means_no_multicast() -> None:
    quiet = _healthy(sightings=(), bonjour_peers=frozenset(), seeds=("192.168.1.98:7471",))
    f = _one(diagnose(quiet), "no_multicast")
    assert "--peer 192.168.1.98:7471" in f.what and "5353" in f.fix
    early = _healthy(sightings=(), bonjour_peers=frozenset(), discovery_s=BONJOUR_SETTLE_S - 1)
    assert diagnose(early).findings == []
    assert diagnose(_healthy(sightings=(), discovery="off")).findings == []
    assert _codes(diagnose(_healthy(discovery="failed"))) == {"bonjour_unavailable": "warning"}


def test_addresses_on_bridges_and_vpns_are_named() -> None:
    ifaces = (
        Interface("eth0", "192.168.1.97", 24),
        Interface("docker0", "172.17.0.1", 16),
        Interface("tailscale0", "100.64.0.5", 10),
    )
    f = _one(
        diagnose(_healthy(interfaces=ifaces, advertised=("172.17.0.1", "100.64.0.5"))),
        "virtual_address",
    )
    assert "docker0" in f.what and "tailscale0" in f.what and "--advertise" in f.fix
    r = diagnose(_healthy(interfaces=ifaces, dialled={"b": "172.17.0.3"}))
    assert _one(r, "bridge_address").severity == "warning"
    r = diagnose(_healthy(interfaces=ifaces, dialled={"b": "100.64.0.9"}))
    assert _one(r, "vpn_address").severity == "info"
    # A bridge beside a LAN address is what most hosts have: nothing to say.
    both = _healthy(interfaces=ifaces, advertised=("192.168.1.97", "172.17.0.1"))
    assert diagnose(both).findings == []


def _instance(*nodes: str) -> Instance:
    stages = [
        Stage(node=n, start=i * 4, end=i * 4 + 4, engine="llama_cpp") for i, n in enumerate(nodes)
    ]
    return Instance(id="i1", spec=InstanceSpec(model="m"), stages=stages, facts=FACTS)


def test_a_runner_given_up_and_a_plan_that_cannot_be_repaired_are_named() -> None:
    inst = _instance("a", "b")
    crashed = RunnerStatus(
        instance="i1",
        generation=1,
        stage=1,
        state="failed",
        reason=f"{CRASH_LOOP}: exited 3 times in 60 s",
    )
    ready = RunnerStatus(instance="i1", generation=1, stage=0, state="ready", port=5000)
    # The model needs ~4 GiB; a alone offers 2 GiB: no repair without b.
    v = _view(
        [_card("a", mem=2 * GiB), _card("b")],
        instances=[inst],
        healths={
            "a": Health(seq=1, mem_available=2 * GiB, runners=[ready]),
            "b": Health(seq=1, runners=[crashed]),
        },
    )
    r = diagnose(_healthy(view=v))
    gave = _one(r, "runner_given_up")
    assert gave.severity == "warning" and CRASH_LOOP in gave.what and "'n-b'" in gave.what
    bad = _one(r, "unrepairable")
    assert bad.severity == "error" and "instance i1 (m) cannot serve" in bad.what
    assert "meshctl rm i1" in bad.fix
    # The same plan, both runners ready: nothing.
    ok = RunnerStatus(instance="i1", generation=1, stage=1, state="ready", port=5001)
    v = _view(
        [_card("a"), _card("b")],
        instances=[inst],
        healths={"a": Health(seq=1, runners=[ready]), "b": Health(seq=1, runners=[ok])},
    )
    assert diagnose(_healthy(view=v)).findings == []


def test_little_free_disk_under_the_slice_cache_is_named() -> None:
    f = _one(diagnose(_healthy(disk_free=1 * GiB)), "disk_low")
    assert f.severity == "warning" and "/data/cache" in f.what
    assert _one(diagnose(_healthy(disk_free=DISK_ERROR_BYTES - 1)), "disk_low").severity == "error"


def test_render_prints_each_finding_and_its_fix_and_sets_the_exit_code() -> None:
    report = {
        "node": "a",
        "name": "studio",
        "findings": [
            {
                "severity": "error",
                "code": "ports_closed",
                "what": "node [b] is alive but x",
                "fix": "open TCP port 7471",
            },
            {
                "severity": "warning",
                "code": "other_cluster",
                "what": "node 'c' elsewhere",
                "fix": "start it with --cluster home",
            },
        ],
        "checked": [{"name": "ports", "detail": "3 ports of 1 peer probed"}],
    }
    console = Console(width=200, record=True, color_system=None)
    console.print(render(report))
    text = console.export_text()
    assert "error   node [b] is alive but x" in text  # markup in a message stays text
    assert "fix: open TCP port 7471" in text and "fix: start it with --cluster home" in text
    assert "1 error, 1 warning" in text and "ports: 3 ports of 1 peer probed" in text
    assert exit_code(report) == 1
    report["findings"] = report["findings"][1:]
    assert exit_code(report) == 0
    assert exit_code({"findings": []}) == 0


# -- real nodes on loopback -------------------------------------------------------------


def _doctor(node: NodeProc, *extra: str) -> tuple[int, dict[str, Any]]:
    """`meshctl doctor --json` against ``node``: exit code and report."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshd.cli.meshctl",
            "--node",
            node.api.removeprefix("http://"),
            "doctor",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def _found(report: dict[str, Any], code: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["code"] == code]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, NodeProc, NodeProc]]:
    """Two members by a shared secret file, on loopback, Bonjour off."""
    with Cluster(tmp_path_factory.mktemp("doctor")) as c:
        a = c.start("a")
        b = c.start("b", peers=[a])
        wait_for(lambda: set(a.liveness().values()) == {"alive"} and len(a.liveness()) == 2, 15)
        yield c, a, b


@pytest.mark.timeout(60)
def test_doctor_finds_nothing_wrong_in_a_healthy_pair(pair) -> None:
    _, a, b = pair

    def failed_handshakes() -> int:
        dropped = b.get("/healthz")["dropped"]
        return sum(n for by in dropped.values() for k, n in by.items() if k.startswith("hand"))

    before = failed_handshakes()
    code, report = _doctor(a)
    assert code == 0, report
    assert not [f for f in report["findings"] if f["severity"] == "error"], report
    ports = next(c for c in report["checked"] if c["name"] == "ports")
    assert ports["detail"].startswith("3 ports of 1 peer") and "3 answer" in ports["detail"]
    # The human form, as a user sees it.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshd.cli.meshctl",
            "--node",
            a.api.removeprefix("http://"),
            "doctor",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0 and "nothing wrong found" in r.stdout, r.stdout + r.stderr
    # The probes speak ZMTP with the node's own keys: the peer counts no failed handshake.
    assert failed_handshakes() == before


@pytest.mark.timeout(60)
def test_doctor_names_a_node_refused_for_another_clusters_secret(pair, tmp_path: Path) -> None:
    c, _, b = pair
    other = tmp_path / "other.secret"
    write_secret(other)
    x = c.start("x-other", peers=[b], extra_args=["--secret-file", str(other)])
    try:
        wait_for(lambda: b.get("/healthz")["dropped"].get("join", {}).get("bad_proof", 0), 10)
    finally:
        x.terminate()
    code, report = _doctor(b)
    assert code == 1, report
    f = next(f for f in _found(report, "join_refused") if "x-other" in f["what"])
    assert f["severity"] == "error" and "127.0.0.1" in f["what"]
    assert "another cluster's secret" in f["what"] and "--secret-file" in f["fix"]


@pytest.mark.timeout(60)
def test_doctor_names_a_key_that_is_no_members_turned_away_by_zap(pair) -> None:
    _, _, b = pair
    # b's own server key, but a client key no member approved: the handshake gets as
    # far as ZAP, which says no.
    ident = HandMember.ask(zmq.Context.instance(), b, wire.JoinWho())
    assert isinstance(ident, wire.JoinIdent)
    server_key = curve_public_of(ident.key)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    secure(sub, CurveKeys.generate(), server=False, server_key=server_key)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{b.pub_port}")
    try:

        def named() -> dict[str, Any] | None:
            code, report = _doctor(b)
            hits = [f for f in _found(report, "zap_refused") if "127.0.0.1" in f["what"]]
            return hits[0] if code == 1 and hits else None

        f = wait_for(named, 15, interval=0.5)
    finally:
        sub.close(0)
    assert f["severity"] == "error" and "no member's" in f["what"]


@pytest.mark.timeout(60)
def test_doctor_names_a_second_process_with_the_same_node_id(pair, tmp_path: Path) -> None:
    c, _, b = pair
    clone = tmp_path / "clone"
    shutil.copytree(b.data_dir, clone, ignore=shutil.ignore_patterns("meshd.lock"))
    # What a cloned VM's disk holds: b's id under a fingerprint that matches (see
    # tests/node/test_cluster.py).
    (clone / ID_FILE).write_text(
        json.dumps({"node_id": b.node_id, "fingerprint": fingerprint(clone)})
    )
    twin = c.start("b-clone", peers=[b], data_dir=clone, wait=False)
    assert twin.proc.wait(15) == 3, twin.log()  # the later one gives way (EXIT_ID_CLASH)
    code, report = _doctor(b)
    assert code == 1, report
    f = _found(report, "duplicate_id")[0]
    assert "'b-clone' at 127.0.0.1:" in f["what"] and "identity.json" in f["fix"]


# -- real nodes in network namespaces (Bonjour on) --------------------------------------

REPO = Path(__file__).resolve().parents[2]


def _up(host: Host, tmp: Path, name: str, *extra: str) -> subprocess.Popen[bytes]:
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    return host.popen(
        [
            sys.executable,
            "-m",
            "meshd.cli.meshd",
            "up",
            "--name",
            name,
            "--no-model",
            "--data-dir",
            str(tmp / name),
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), "MESHD_THREADS": "1"},
    )


def _meshctl(host: Host, *args: str) -> subprocess.CompletedProcess[str]:
    return host.run([sys.executable, "-m", "meshd.cli.meshctl", *args], timeout=30)


def _lan_doctor(host: Host) -> tuple[int, dict[str, Any]]:
    r = _meshctl(host, "doctor", "--json")
    return r.returncode, (json.loads(r.stdout) if r.returncode in (0, 1) else {"findings": []})


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Host], Path]]:
    """h0, h1: members by one secret, finding each other over Bonjour; h2: a node of
    another cluster (its own secret, --cluster other) on the same LAN."""
    require_netns()
    tmp = tmp_path_factory.mktemp("doctor-lan")
    ours, theirs = tmp / "ours.secret", tmp / "theirs.secret"
    write_secret(ours)
    write_secret(theirs)
    with Netns.lan(n=3, prefix="mdd") as net:
        h0, h1, h2 = net.hosts
        _up(h0, tmp, "h0", "--secret-file", str(ours))
        _up(h1, tmp, "h1", "--secret-file", str(ours))
        _up(h2, tmp, "h2", "--secret-file", str(theirs), "--cluster", "other")

        def paired() -> bool:
            r = _meshctl(h0, "nodes", "--json")
            nodes = json.loads(r.stdout) if r.returncode == 0 else []
            return {n["name"]: n["liveness"] for n in nodes} == {"h0": "alive", "h1": "alive"}

        try:
            wait_for(paired, 40, interval=0.5)
        except TimeoutError:
            logs = "\n".join(p.read_text(errors="replace") for p in tmp.glob("*.log"))
            pytest.fail(f"h0 and h1 did not pair over Bonjour:\n{logs}")
        yield net.hosts, tmp


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_doctor_names_a_node_of_another_cluster_on_the_lan(lan) -> None:
    (h0, _h1, _h2), _ = lan

    def named() -> dict[str, Any] | None:
        _, report = _lan_doctor(h0)
        hits = [f for f in _found(report, "other_cluster") if "'h2'" in f["what"]]
        return hits[0] if hits else None

    f = wait_for(named, 30, interval=1.0)
    assert f["severity"] == "warning" and "10.99.0.12" in f["what"] and "'other'" in f["what"]
    assert "--cluster default" in f["fix"]
    code, report = _lan_doctor(h0)
    assert code == 0, report  # another household's node is no error of this cluster
    assert not _found(report, "ports_closed") and not _found(report, "no_multicast")


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_doctor_names_a_member_whose_ports_a_firewall_drops(lan) -> None:
    if shutil.which("nft") is None:
        pytest.skip("nft (nftables) is not installed: apt-get install -y nftables")
    (h0, h1, _h2), _ = lan
    card = next(
        n["card"] for n in json.loads(_meshctl(h0, "nodes", "--json").stdout) if n["name"] == "h1"
    )
    mesh, data = card["mesh_port"], card["data_port"]
    for rule in (
        ["add", "table", "inet", "mdd"],
        [
            "add",
            "chain",
            "inet",
            "mdd",
            "input",
            "{ type filter hook input priority 0 ; policy accept ; }",
        ],
        ["add", "rule", "inet", "mdd", "input", "tcp", "dport", f"{{ {mesh}, {data} }}", "drop"],
    ):
        r = h1.run(["nft", *rule])
        assert r.returncode == 0, r.stderr

    def named() -> dict[str, Any] | None:
        code, report = _lan_doctor(h0)
        hits = [f for f in _found(report, "ports_closed") if "'h1'" in f["what"]]
        return hits[0] if code == 1 and hits else None

    f = wait_for(named, 30, interval=1.0)
    assert f["severity"] == "error" and "10.99.0.11" in f["what"]
    assert f"mesh {mesh}" in f["what"] and f"data {data}" in f["what"]
    assert "do not answer" in f["what"] and f"{mesh}, {data}" in f["fix"]
    # The PUB port still answers: h1 is alive, only its mesh and data ports are cut.
    assert f"pub {card['pub_port']}" not in f["what"]

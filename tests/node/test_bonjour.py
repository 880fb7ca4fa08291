"""`meshd up` with no peers, in separate network namespaces, forms a cluster over Bonjour."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.netns import Host, Netns, require_netns

pytestmark = [pytest.mark.timeout(90), pytest.mark.netns]

REPO = Path(__file__).resolve().parents[2]


def _up(host: Host, tmp: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`meshd up` inside ``host``'s namespace with default ports and no peer."""
    log = open(tmp / f"{host.name}.log", "wb")  # noqa: SIM115 - closed with the process
    return host.popen(
        [sys.executable, "-m", "meshd.cli.meshd", "up", "--name", f"h{host.index}",
         "--data-dir", str(tmp / host.name), *extra],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def _nodes(host: Host) -> dict[str, str]:
    """Node name -> liveness, asked of the node in ``host`` through `meshctl nodes --json`."""
    r = host.run([sys.executable, "-m", "meshd.cli.meshctl", "nodes", "--json"], timeout=15)
    if r.returncode != 0:
        return {}
    return {n["name"]: n["liveness"] for n in json.loads(r.stdout)}


def test_two_open_meshd_up_with_no_peer_find_each_other_over_bonjour(tmp_path: Path) -> None:
    require_netns()
    with Netns.lan(n=3, prefix="mdb") as lan:
        h0, h1, stranger = lan.hosts
        _up(h0, tmp_path, "--open")
        _up(h1, tmp_path, "--open")
        _up(stranger, tmp_path, "--open", "--cluster", "someone-else")
        _assert_both_see_both(h0, h1, tmp_path)
        # The node of another cluster saw the same adverts and joined nobody.
        assert _nodes(stranger) == {"h2": "alive"}


def test_a_new_machine_finds_the_cluster_over_bonjour_and_joins_by_approval(
    tmp_path: Path,
) -> None:
    require_netns()
    with Netns.lan(n=2, prefix="mdj") as lan:
        h0, h1 = lan.hosts
        _up(h0, tmp_path)  # no flags: the first machine starts the cluster
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _nodes(h0) != {"h0": "alive"}:
            time.sleep(0.3)
        _up(h1, tmp_path)  # no flags, no peer: it finds h0 on Bonjour and asks
        log1 = tmp_path / f"{h1.name}.log"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "waiting for a member" not in log1.read_text():
            time.sleep(0.3)
        assert _nodes(h1) == {}  # not in yet: no API, no state
        code = re.findall(r"meshctl approve ([0-9A-Z]{4}-[0-9A-Z]{4})", log1.read_text())[-1]
        r = h0.run([sys.executable, "-m", "meshd.cli.meshctl", "approve", code], timeout=30)
        assert r.returncode == 0, r.stderr
        _assert_both_see_both(h0, h1, tmp_path)


def _assert_both_see_both(h0: Host, h1: Host, tmp: Path, timeout: float = 30) -> None:
    """Within ``timeout``, each of h0 and h1 sees exactly the two of them alive."""
    both = {"h0": "alive", "h1": "alive"}
    deadline = time.monotonic() + timeout
    views: list[dict[str, str]] = [{}, {}]
    while time.monotonic() < deadline:
        views = [_nodes(h0), _nodes(h1)]
        if views == [both, both]:
            return
        time.sleep(0.5)
    logs = "\n".join(p.read_text(errors="replace") for p in tmp.glob("*.log"))
    assert views == [both, both], logs

"""`meshd up` with no peers, in separate network namespaces, forms a cluster over Bonjour."""

from __future__ import annotations

import json
import os
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


def test_two_meshd_up_with_no_peer_find_each_other_over_bonjour(tmp_path: Path) -> None:
    require_netns()
    with Netns.lan(n=3, prefix="mdb") as lan:
        h0, h1, stranger = lan.hosts
        _up(h0, tmp_path)
        _up(h1, tmp_path)
        _up(stranger, tmp_path, "--cluster", "someone-else")
        deadline = time.monotonic() + 30
        views: list[dict[str, str]] = [{}, {}]
        while time.monotonic() < deadline:
            views = [_nodes(h0), _nodes(h1)]
            if all(v == {"h0": "alive", "h1": "alive"} for v in views):
                break
            time.sleep(0.5)
        logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
        assert views == [{"h0": "alive", "h1": "alive"}] * 2, logs
        # The node of another cluster saw the same adverts and joined nobody.
        assert _nodes(stranger) == {"h2": "alive"}

"""Getting into a cluster, for real: approval, pairing codes, secret files, --open.

Nodes on loopback, started as a user would (no secret file unless the test says so).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time

import httpx
import pytest

from meshd.models import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for

pytestmark = pytest.mark.timeout(180)


def meshctl(node: NodeProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "--node", node.api, *args],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def members(node: NodeProc) -> dict:
    return node.get("/v1/members")


def shown_code(node: NodeProc) -> str:
    """The approval code a waiting node shows (its stderr, in the log)."""
    got = re.findall(r"meshctl approve ([0-9A-Z]{4}-[0-9A-Z]{4})", node.log())
    assert got, node.log()[-2000:]
    return got[-1]


def test_two_nodes_with_no_flags_join_by_one_approval_and_serve_a_split(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    a = cluster.start("a", secret=False)  # the first machine: it starts the cluster
    assert "started a new cluster" in a.log()
    b = cluster.start("b", peers=[a], secret=False, wait=False)
    wait_for(lambda: "waiting for a member to approve" in b.log(), 30)
    got = members(a)
    assert [m["name"] for m in got["data"]] == ["a"]
    assert [p["name"] for p in got["pending"]] == ["b"]
    assert "meshd ready" not in b.log()  # nothing of the cluster before approval
    assert f"id {b_id(b)}" in b.log()  # the id the owner sees in `meshctl members`
    by_name = meshctl(a, "approve", "b")  # a name approves nothing: the list, the code asked
    assert by_name.returncode != 0 and "code" in by_name.stderr, by_name.stderr
    assert "b (id" in by_name.stderr, by_name.stderr
    # What `meshctl approve CODE` sends (its own start is seconds on a loaded machine).
    r = httpx.post(a.api + "/v1/members", json={"approve": shown_code(b)}, timeout=10)
    approved = time.monotonic()
    assert r.status_code == 202 and [p["name"] for p in r.json()["data"]] == ["b"], r.text
    cluster.wait_ready(b, timeout=30)
    ready_s = time.monotonic() - approved
    wait_for(lambda: {n["name"]: n["liveness"] for n in b.cluster()["nodes"]}
             == {"a": "alive", "b": "alive"}, 15)  # fmt: skip
    assert sorted(m["name"] for m in members(b)["data"]) == ["a", "b"]
    # A split over both serves.
    r = httpx.post(a.api + "/v1/instances", timeout=120,
                   json={"model": DEFAULT_MODEL, "nodes": ["a", "b"]})  # fmt: skip
    assert r.status_code == 201, r.text
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    chat = wait_for(lambda: _chat(b, body), 90, interval=0.5)
    serving_s = time.monotonic() - approved
    assert chat["choices"][0]["message"]["content"]
    with capsys.disabled():
        print(f"\napproval -> ready {ready_s:.2f} s; approval -> split answered {serving_s:.2f} s")
    assert ready_s < 5.0


def b_id(node: NodeProc) -> str:
    return json.loads((node.data_dir / "identity.json").read_text())["node_id"]


def _chat(node: NodeProc, body: dict) -> dict | None:
    r = httpx.post(node.api + "/v1/chat/completions", json=body, timeout=60)
    return r.json() if r.status_code == 200 else None


def test_a_pairing_code_lets_one_node_in_once(cluster: Cluster) -> None:
    a = cluster.start("a", secret=False)
    r = meshctl(a, "invite")
    assert r.returncode == 0, r.stderr
    code = r.stdout.strip()
    assert re.fullmatch(r"[0-9A-Z]{4}-[0-9A-Z]{4}-[0-9A-Z]{4}", code), code
    b = cluster.start("b", peers=[a], secret=False, extra_args=["--join", code])
    assert sorted(m["name"] for m in members(a)["data"]) == ["a", "b"]
    wait_for(lambda: len(b.cluster()["nodes"]) == 2, 15)
    # One use: a third node with the same code is not let in, and is told so at once.
    c = cluster.start("c", peers=[a], secret=False, extra_args=["--join", code], wait=False)
    assert c.proc.wait(30) == 1
    assert "could not join: this pairing code was used" in c.log(), c.log()[-2000:]
    assert "Traceback" not in c.log()
    assert sorted(m["name"] for m in members(a)["data"]) == ["a", "b"]


def test_a_wrong_code_fails_and_gives_nothing_away(cluster: Cluster) -> None:
    a = cluster.start("a", secret=False)
    r = meshctl(a, "invite")
    code = r.stdout.strip()
    wrong = code[:5] + ("0000-0000" if code[5:] != "0000-0000" else "1111-1111")
    b = cluster.start("b", peers=[a], secret=False, extra_args=["--join", wrong], wait=False)
    assert b.proc.wait(30) != 0
    assert "wrong pairing code" in b.log()
    assert not (b.data_dir / "cluster.key").exists()  # no key reached it
    assert [m["name"] for m in members(a)["data"]] == ["a"]
    # Three wrong tries burn the code: the right one no longer works either.
    for i in range(2):
        x = cluster.start(f"x{i}", peers=[a], secret=False, extra_args=["--join", wrong],
                          wait=False)  # fmt: skip
        assert x.proc.wait(30) != 0
    late = cluster.start("late", peers=[a], secret=False, extra_args=["--join", code],
                         wait=False)  # fmt: skip
    assert late.proc.wait(30) == 1
    assert "burned" in late.log() and "meshd ready" not in late.log()


def test_ctrl_c_while_looking_for_a_cluster_exits_130_in_one_line(cluster: Cluster) -> None:
    with socket.socket() as s:  # a seed where nothing answers (its join port neither)
        s.bind(("127.0.0.1", 0))
        seed = f"127.0.0.1:{s.getsockname()[1]}"
        b = cluster.start("b", secret=False, extra_args=["--peer", seed], wait=False,
                          ctrl_c=True)  # fmt: skip
        wait_for(lambda: "looking for members to approve this node" in b.log(), 30)
    b.proc.send_signal(signal.SIGINT)
    assert b.proc.wait(10) == 130
    assert "Traceback" not in b.log()
    assert b.log().strip().splitlines()[-1] == "meshd: interrupted before the node was up"


def test_nodes_with_the_same_secret_file_are_members_at_once(cluster: Cluster) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    c = cluster.start("c", peers=[b])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 3 for n in (a, b, c)), 20)
    assert sorted(m["name"] for m in members(c)["data"]) == ["a", "b", "c"]
    assert a.get("/healthz")["secured"] is True


def test_open_still_forms_an_open_cluster(cluster: Cluster) -> None:
    a = cluster.start("a", extra_args=["--open"])
    b = cluster.start("b", peers=[a], extra_args=["--open"])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)
    assert a.get("/healthz")["secured"] is False
    assert "OPEN cluster" in a.log()
    r = httpx.get(a.api + "/v1/members", timeout=10)
    assert r.status_code == 409 and r.json()["error"]["code"] == "open_cluster"


def test_a_secured_node_and_an_open_one_do_not_mix(cluster: Cluster) -> None:
    a = cluster.start("a", secret=False)
    b = cluster.start("b", peers=[a], extra_args=["--open"])

    def turned_away() -> int:
        """b's clear-text connections that a's sockets refused (no CURVE handshake)."""
        mesh = a.get("/healthz")["dropped"].get("mesh", {})
        return sum(n for reason, n in mesh.items() if reason.startswith("handshake"))

    # Looked at once b's hello has reached a and been refused: the only way in b has.
    wait_for(turned_away, 15)
    assert [n["name"] for n in a.cluster()["nodes"]] == ["a"]
    assert [n["name"] for n in b.cluster()["nodes"]] == ["b"]
    assert json.dumps(a.cluster()).count(b.node_id) == 0


def test_a_key_in_meshctl_top_approves_a_waiting_node(cluster: Cluster) -> None:
    a = cluster.start("a", secret=False)
    b = cluster.start("b", peers=[a], secret=False, wait=False)
    wait_for(lambda: [p["name"] for p in members(a)["pending"]] == ["b"], 30)
    # meshctl top on a real terminal (a pty): it lists b as waiting; the key 1 lets it in.
    pid, fd = pty.fork()
    if pid == 0:  # the child: become meshctl top, on a terminal of 50 rows (the prompt shows)
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
        os.environ.update(LINES="50", COLUMNS="120", TERM="xterm")
        os.execv(sys.executable, [sys.executable, "-m", "meshd.cli.meshctl", "--node", a.api,
                                  "top", "--interval", "0.5"])  # fmt: skip
    screen = b""
    try:
        deadline = time.monotonic() + 30
        while b"waiting to join" not in screen and time.monotonic() < deadline:
            screen += _read(fd)
        assert b"waiting to join" in screen, screen[-2000:]
        deadline = time.monotonic() + 30
        while b"Enter approves" not in screen and time.monotonic() < deadline:
            os.write(fd, b"1")  # picks b (again if a slow frame had no list yet)
            for _ in range(6):
                screen += _read(fd)
        assert b"Enter approves" in screen, screen[-2000:]
        assert members(a)["pending"]  # nothing happens before its code is typed
        # Backspaces first: a "1" pressed again once b was picked went into the code.
        os.write(fd, b"\x7f" * 9 + shown_code(b).lower().encode() + b"\r")
        # Read on while waiting: a full pty would stop top in the middle of a frame.
        deadline = time.monotonic() + 30
        while b"approved b" not in screen and time.monotonic() < deadline:
            screen += _read(fd)
        assert b"approved b" in screen, screen[-2000:]
        while "meshd ready" not in b.log() and time.monotonic() < deadline:
            screen += _read(fd)
        cluster.wait_ready(b, timeout=5)
        assert sorted(m["name"] for m in members(a)["data"]) == ["a", "b"]
        os.write(fd, b"q")  # q quits, and the terminal is given back as it was
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def _read(fd: int) -> bytes:
    ready, _, _ = select.select([fd], [], [], 0.5)
    if not ready:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:  # the child closed its side
        return b""

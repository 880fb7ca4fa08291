"""The files of ``examples/`` do what they say: the service definitions parse and carry
the restart and stop rules, the launchd wrapper maps exit codes and passes SIGTERM on,
and the two runnable examples work against real nodes."""

from __future__ import annotations

import json
import os
import plistlib
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshd.cli.meshd import _parser as meshd_parser
from meshd.models.resolve import DEFAULT_MODEL
from meshd.node.config import API_STOP_GRACE_S, DRAIN_TIMEOUT_S, STOP_GRACE_S
from meshd.node.twins import EXIT_ID_CLASH
from tests.cluster import Cluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
UNIT = EXAMPLES / "systemd" / "meshd.service"
PLIST = EXAMPLES / "launchd" / "dev.meshd.plist"
WRAPPER = EXAMPLES / "launchd" / "meshd-launchd.sh"
CHAT = EXAMPLES / "chat_openai.py"
THREE = EXAMPLES / "three_nodes.sh"
REAPER = Path(__file__).with_name("reaper.py")

#: What a supervisor must wait for after SIGTERM before it may SIGKILL a node.
STOP_BUDGET_S = DRAIN_TIMEOUT_S + API_STOP_GRACE_S + STOP_GRACE_S


def _env(**extra: str) -> dict[str, str]:
    """This environment without meshd's own variables, and with this Python's scripts
    (meshd, meshctl) first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHD_", "MESHCTL_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra)
    return env


# ---------------------------------------------------------------- systemd


def _unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file: section -> key -> values (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] | None = None
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines).strip()
        assert section is not None, f"a setting outside any section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a setting: {raw!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def _seconds(value: str) -> float:
    """A systemd time span: ``90``, ``90s``, ``1min 30s``, ``2m``."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(num) * units[unit]
    return total


def _exec_argv(unit: dict[str, dict[str, list[str]]]) -> list[str]:
    (line,) = unit["Service"]["ExecStart"]
    argv = shlex.split(line.lstrip("-@:+!"))
    return argv[1:] if argv[0] == "/usr/bin/env" else argv


def test_systemd_unit_runs_meshd_up_with_the_restart_and_stop_rules() -> None:
    unit = _unit(UNIT.read_text())
    svc = unit["Service"]
    argv = _exec_argv(unit)
    assert Path(argv[0]).name == "meshd" and argv[1] == "up", argv
    assert argv[0] in ("%h/.local/bin/meshd", "meshd"), argv[0]
    # meshd's own parser takes the arguments (a typo in a flag fails here).
    args = meshd_parser().parse_args([a.replace("%h", "/home/u") for a in argv[1:]])
    assert args.command == "up"
    assert args.secret_file is not None and "%" not in str(args.secret_file)

    assert svc["Restart"] == ["on-failure"]
    assert str(EXIT_ID_CLASH) in svc["RestartPreventExitStatus"][-1].split()
    assert "1" not in svc["RestartPreventExitStatus"][-1].split()  # busy port: retry
    (stop,) = svc["TimeoutStopSec"]
    assert _seconds(stop) > STOP_BUDGET_S > 30
    # SIGTERM to meshd alone: its runners keep serving while it drains.
    assert svc["KillMode"] == ["mixed"]
    assert svc.get("KillSignal", ["SIGTERM"]) == ["SIGTERM"]
    assert svc["NoNewPrivileges"] == ["yes"]
    assert "MemoryDenyWriteExecute" not in svc  # llama-cpp-python's ctypes callbacks
    assert unit["Install"]["WantedBy"] == ["default.target"]


@pytest.mark.timeout(60)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    meshd = shutil.which("meshd", path=_env()["PATH"])
    if meshd is None:
        pytest.skip("meshd is not on PATH")
    # verify wants ExecStart's binary to exist: this machine's meshd in a copy.
    text = UNIT.read_text()
    assert "ExecStart=%h/.local/bin/meshd " in text
    copy = tmp_path / "meshd.service"
    copy.write_text(text.replace("ExecStart=%h/.local/bin/meshd ", f"ExecStart={meshd} "))
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_COLOR": "0"}

    def verify(*mode: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [analyze, *mode, "verify", "--man=no", str(copy)],
            capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path,
        )  # fmt: skip

    r = verify("--user")
    if r.returncode != 0 and "Failed to initialize manager" in r.stderr:
        r = verify()  # no user manager can be set up here: the system manager's rules
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "meshd.service" not in out, out  # every warning about the file names it


# ---------------------------------------------------------------- launchd


def test_launchd_plist() -> None:
    with PLIST.open("rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "dev.meshd"
    argv = plist["ProgramArguments"]
    assert argv[0] == "/Users/YOU/.local/bin/" + WRAPPER.name
    args = meshd_parser().parse_args(argv[1:])
    assert args.command == "up" and args.secret_file is not None
    # Restarted after a non-zero exit only (the wrapper turns 3 into 0).
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["RunAtLoad"] is True
    assert plist["ExitTimeOut"] > STOP_BUDGET_S
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert plist[key].startswith("/Users/YOU/Library/Logs/"), plist[key]
    # One placeholder for the home, replaced by the sed line of the install steps.
    text = PLIST.read_text()
    assert set(re.findall(r"/Users/[^/<\s]+", text)) == {"/Users/YOU"}
    assert 'sed "s|/Users/YOU|$HOME|g" dev.meshd.plist' in WRAPPER.read_text()
    plutil = shutil.which("plutil")
    if plutil is not None and sys.platform == "darwin":
        subprocess.run([plutil, "-lint", str(PLIST)], check=True, timeout=30)


def _shells() -> list[str]:
    # /bin/sh runs it (its shebang); bash is macOS's /bin/sh.
    return [s for s in ("sh", "bash") if shutil.which(s)]


@pytest.fixture
def fake_meshd(tmp_path: Path) -> Path:
    """A `meshd` that records its arguments and exits with $FAKE_RC, or (FAKE_RC=term)
    runs until SIGTERM, then exits 0 after a short drain."""
    fake = tmp_path / "bin" / "meshd"
    fake.parent.mkdir()
    fake.write_text(
        textwrap.dedent("""\
            #!/bin/sh
            printf '%s\\n' "$@" > "$FAKE_DIR/args"
            if [ "$FAKE_RC" != term ]; then exit "$FAKE_RC"; fi
            drain() { echo term >> "$FAKE_DIR/log"; sleep 0.3; echo done >> "$FAKE_DIR/log"; }
            trap 'drain; exit 0' TERM
            echo started >> "$FAKE_DIR/log"
            while :; do sleep 0.05; done
            """)
    )
    fake.chmod(0o755)
    return fake


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shell", _shells())
@pytest.mark.parametrize(("meshd_rc", "wrapper_rc"), [(0, 0), (1, 1), (2, 2), (3, 0), (7, 7)])
def test_launchd_wrapper_maps_exit_3_to_0(
    fake_meshd: Path, shell: str, meshd_rc: int, wrapper_rc: int
) -> None:
    assert os.access(WRAPPER, os.X_OK), "the wrapper must be executable"
    assert WRAPPER.read_text().startswith("#!/bin/sh\n")
    d = fake_meshd.parent.parent
    env = _env(FAKE_DIR=str(d), FAKE_RC=str(meshd_rc))
    env["PATH"] = os.pathsep.join([str(fake_meshd.parent), env["PATH"]])
    r = subprocess.run(
        [shell, str(WRAPPER), "up", "--secret-file", "/a b/s"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == wrapper_rc, r.stderr
    assert (d / "args").read_text().splitlines() == ["up", "--secret-file", "/a b/s"]
    assert ("exited 3" in r.stderr) == (meshd_rc == 3), r.stderr


@pytest.mark.timeout(60)
def test_launchd_wrapper_uses_MESHD(fake_meshd: Path) -> None:
    d = fake_meshd.parent.parent
    env = _env(FAKE_DIR=str(d), FAKE_RC="3", MESHD=str(fake_meshd))
    r = subprocess.run([str(WRAPPER), "up"], env=env, capture_output=True, timeout=30)
    assert r.returncode == 0 and (d / "args").read_text() == "up\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shell", _shells())
def test_launchd_wrapper_passes_sigterm_on_and_waits(fake_meshd: Path, shell: str) -> None:
    d = fake_meshd.parent.parent
    env = _env(FAKE_DIR=str(d), FAKE_RC="term", MESHD=str(fake_meshd))
    p = subprocess.Popen([shell, str(WRAPPER), "up"], env=env, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (d / "log").exists(), 10)
        p.send_signal(signal.SIGINT)  # not passed on (a terminal's Ctrl-C reaches meshd)
        time.sleep(0.3)
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    # meshd got SIGTERM once, and the wrapper waited for it to finish its drain.
    assert (d / "log").read_text().splitlines() == ["started", "term", "done"]


# ---------------------------------------------------------------- chat_openai.py

API_KEY = "sk-examples-test"


@pytest.fixture(scope="module")
def keyed_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One node started with an API key, serving the default model; its base URL."""
    pytest.importorskip("openai")
    with Cluster(tmp_path_factory.mktemp("chat")) as c:
        a = c.start("a", extra_args=["--api-host", "127.0.0.1"], env={"MESHD_API_KEY": API_KEY})
        auth = {"Authorization": f"Bearer {API_KEY}"}
        r = httpx.post(a.api + "/v1/instances", headers=auth, timeout=60,
                       json={"model": DEFAULT_MODEL, "nodes": ["a"]})  # fmt: skip
        assert r.status_code == 201, r.text
        path = a.api + f"/v1/instances/{r.json()['id']}"
        wait_for(
            lambda: all(
                s["state"] == "ready"
                for s in httpx.get(path, headers=auth, timeout=5).json()["stages"]
            ),
            90, 0.2,
        )  # fmt: skip
        yield a.api


def _chat(
    base: str, *args: str, key: str | None = API_KEY, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    env = _env(**({"MESHD_API_KEY": key} if key else {}))
    return subprocess.run(
        [sys.executable, str(CHAT), "--base-url", base + "/v1", "--max-tokens", "24",
         "--temperature", "0", *args],
        env=env, input=stdin, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.timeout(180)
def test_chat_openai_one_shot(model_path: Path, keyed_node: str) -> None:
    r = _chat(keyed_node, "Say", "hello.")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), (r.stdout, r.stderr)


@pytest.mark.timeout(180)
def test_chat_openai_conversation(model_path: Path, keyed_node: str) -> None:
    r = _chat(keyed_node, "--system", "You are brief.", stdin="Hi!\n\nName a color.\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"chatting with {DEFAULT_MODEL} at {keyed_node}/v1 (Ctrl-D to quit)"
    # Two answers after two prompts (the empty line asks nothing).
    answers = [chunk for chunk in r.stdout.split("> ")[1:] if chunk.strip()]
    assert len(answers) == 2, r.stdout
    assert r.stderr == ""


@pytest.mark.timeout(60)
def test_chat_openai_without_the_key_fails(model_path: Path, keyed_node: str) -> None:
    r = _chat(keyed_node, "Hi", key=None)
    assert r.returncode == 1
    assert "401" in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_chat_openai_without_a_node_fails(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once it is closed
    r = _chat(f"http://127.0.0.1:{port}", "Hi")
    assert r.returncode == 1
    assert "is `meshd up` running?" in r.stderr, r.stderr


# ---------------------------------------------------------------- three_nodes.sh


def _free_base_port(count: int = 9) -> int:
    """The first of ``count`` consecutive ports free on every interface (below the
    ephemeral range, where the nodes' OS-picked PUB ports land)."""
    for _ in range(200):
        base = random.randrange(20000, 30000 - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def _run_three_nodes(tmp_path: Path, timeout: float, **env: str) -> tuple[dict, str, str]:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    for cmd in ("meshd", "meshctl"):
        if shutil.which(cmd, path=_env()["PATH"]) is None:
            pytest.skip(f"{cmd} is not on PATH")
    report = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, str(REAPER), "--report", str(report), "--timeout", str(timeout),
         "--", "bash", str(THREE)],
        env=_env(BASE_PORT=str(_free_base_port()), WORK_DIR=str(tmp_path / "work"), **env),
        capture_output=True, text=True, timeout=timeout + 90,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(report.read_text())
    assert not got["timed_out"], (r.stdout, r.stderr)
    # Nothing it started outlives it: nodes, runners, meshctl.
    assert got["leftovers"] == [], got["leftovers"]
    return got, r.stdout, r.stderr


@pytest.mark.timeout(330)
def test_three_nodes_answers_through_a_split(model_path: Path, tmp_path: Path) -> None:
    got, out, err = _run_three_nodes(tmp_path, timeout=240)
    assert got["rc"] == 0, f"{out}\n{err}"
    for name in "abc":
        assert re.search(rf"^node {name}: meshd ready node=\S+ name={name} ", out, re.M), out
    assert "c sees a, b and c alive" in out
    answer = out.split("--- answer ---\n", 1)[1].split("--- end ---", 1)[0]
    assert answer.strip(), out
    # The split is over a and b (meshctl ls), and each node had a data dir of its own.
    assert re.search(
        r"\ba \([0-9a-f]{8}\)\[0:(\d+)\) llama_cpp ready\b.*\n.*"
        r"\bb \([0-9a-f]{8}\)\[\1:\d+\) llama_cpp ready",
        out,
    )  # meshctl ls: each stage's node by name and id
    assert {p.name for p in (tmp_path / "work").iterdir() if p.is_dir()} == {"a", "b", "c"}


@pytest.mark.timeout(200)
def test_three_nodes_stops_its_nodes_when_it_fails(tmp_path: Path) -> None:
    # A model nobody holds: placing fails after the three nodes are up.
    got, out, err = _run_three_nodes(tmp_path, timeout=120, MODEL="no-such-model-xyz")
    assert got["rc"] != 0
    assert "c sees a, b and c alive" in out
    assert "logs and data dirs kept in" in err, err

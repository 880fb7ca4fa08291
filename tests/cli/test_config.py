"""`meshd up`'s settings from flags, environment, config file and defaults; log formats.

Real `meshd` processes with a controlled environment: no MESHD_ variable of the test
run's own, and a temporary HOME and XDG_CONFIG_HOME, so no real config file is read.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meshd import logs
from meshd.node.supervisor import Supervisor
from meshd.node.supervisor_settings import SupervisorSettings
from tests.node.test_cluster_view import inst

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def _meshd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshd", *args],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def _show(env: dict[str, str], *args: str) -> dict[str, Any]:
    r = _meshd(env, "config", "show", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _error(r: subprocess.CompletedProcess[str]) -> str:
    """The one line a config mistake writes, after checking the exit code."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(
    tmp_path: Path,
) -> None:
    cfg = _write(
        tmp_path / "meshd.toml",
        'api_port = 7001\nmesh_port = 7002\ncluster = "filec"\nmax_tokens = 100\n'
        'peer = ["10.0.0.9:7471"]\n',
    )
    env = _env(tmp_path, MESHD_API_PORT="8001", MESHD_MESH_PORT="8002", MESHD_CLUSTER="envc")
    out = _show(
        env, "--config", str(cfg), "--api-port", "9001", "--cluster", "default",
        "--peer", "10.0.0.2:7480",
    )  # fmt: skip
    assert out["config_file"] == str(cfg)
    s = out["settings"]
    assert s["api_port"] == {"value": 9001, "source": "flag", "env": "MESHD_API_PORT"}
    # A flag given its default's value still wins: it was given.
    assert (s["cluster"]["value"], s["cluster"]["source"]) == ("default", "flag")
    assert (s["mesh_port"]["value"], s["mesh_port"]["source"]) == (8002, "env MESHD_MESH_PORT")
    assert (s["max_tokens"]["value"], s["max_tokens"]["source"]) == (100, f"file {cfg}")
    assert (s["max_requests"]["value"], s["max_requests"]["source"]) == (64, "default")
    # A repeated flag replaces the file's list rather than adding to it.
    assert (s["peer"]["value"], s["peer"]["source"]) == (["10.0.0.2:7480"], "flag")


def test_lists_switches_and_sizes_from_the_file_and_the_environment(tmp_path: Path) -> None:
    cfg = _write(
        tmp_path / "meshd.toml",
        'peer = ["10.0.0.2:7480", "[fe80::1]:7471"]\nmodels = ["~/models"]\nopen = true\n'
        'max-memory = "8G"\nslice_cache = "512M"\nallow_host = "proxy.lan"\n'
        "no_discovery = false\n",
    )
    env = _env(
        tmp_path, MESHD_ADVERTISE=" 10.0.0.1, 10.0.0.2 ,", MESHD_NO_DISCOVERY="yes",
        MESHD_OPEN="0", MESHD_LOG_FORMAT="json",
    )  # fmt: skip
    s = _show(env, "--config", str(cfg))["settings"]
    home = Path(env["HOME"])
    assert s["peer"]["value"] == ["10.0.0.2:7480", "[fe80::1]:7471"]
    assert s["models"]["value"] == [str(home / "models")]  # ~ expanded
    assert s["max_memory"]["value"] == 8 << 30
    assert s["slice_cache"]["value"] == 512 << 20
    assert s["allow_host"]["value"] == ["proxy.lan"]  # one value: a list of one
    assert s["advertise"] == {
        "value": ["10.0.0.1", "10.0.0.2"], "source": "env MESHD_ADVERTISE",
        "env": "MESHD_ADVERTISE",
    }  # fmt: skip
    assert (s["no_discovery"]["value"], s["no_discovery"]["source"]) == (
        True, "env MESHD_NO_DISCOVERY",
    )  # fmt: skip
    # The file says open, the environment says no: the environment wins.
    assert (s["open"]["value"], s["open"]["source"]) == (False, "env MESHD_OPEN")
    assert s["log_format"]["value"] == "json"


def test_unknown_keys_are_each_named_with_the_closest_known_one(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "meshd.toml", "apiport = 7000\nbogus = 1\nmax-tokns = 3\n")
    line = _error(_meshd(_env(tmp_path), "config", "show", "--config", str(cfg)))
    assert line.startswith(f"meshd: {cfg}: unknown settings: "), line
    assert "apiport (did you mean api_port?)" in line
    assert "max-tokns (did you mean max_tokens?)" in line
    assert "bogus" in line
    # `meshd up` refuses it the same way, before it starts anything.
    assert _error(_meshd(_env(tmp_path), "up", "--config", str(cfg))) == line


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('api_port = "x"', "api_port"),
        ("api_port = 70000", "api_port"),
        ('max_memory = "8X"', "max_memory"),
        ('open = "yes"', "open"),
        ('peer = ["h:0"]', "peer"),
        ('log_level = "loud"', "log_level"),
        ("max_requests = 0", "max_requests"),
        ("cluster = true", "cluster"),
        ("forget_after = [1]", "forget_after"),
    ],
)
def test_a_bad_value_names_the_key_and_the_file(tmp_path: Path, text: str, key: str) -> None:
    cfg = _write(tmp_path / "meshd.toml", text + "\n")
    line = _error(_meshd(_env(tmp_path), "config", "show", "--config", str(cfg)))
    assert line.startswith(f"meshd: {cfg}: {key}: "), line


def test_a_bad_environment_value_names_the_variable(tmp_path: Path) -> None:
    line = _error(_meshd(_env(tmp_path, MESHD_OPEN="maybe"), "config", "show"))
    assert line.startswith("meshd: MESHD_OPEN: "), line
    line = _error(_meshd(_env(tmp_path, MESHD_MAX_TOKENS="lots"), "up"))
    assert line.startswith("meshd: MESHD_MAX_TOKENS: max_tokens: "), line


def test_a_file_that_is_not_toml_is_an_error(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "meshd.toml", "peer = [\n")
    line = _error(_meshd(_env(tmp_path), "config", "show", "--config", str(cfg)))
    assert line.startswith(f"meshd: {cfg}: not valid TOML"), line


def test_the_default_location_is_read_and_may_be_absent(tmp_path: Path) -> None:
    env = _env(tmp_path)
    default = Path(env["XDG_CONFIG_HOME"]) / "meshd" / "meshd.toml"
    out = _show(env)  # no file there: defaults, no error
    assert out["config_file"] is None
    assert {v["source"] for v in out["settings"].values()} == {"default"}
    _write(default, 'cluster = "home"\n')
    out = _show(env)
    assert out["config_file"] == str(default)
    assert out["settings"]["cluster"] == {
        "value": "home", "source": f"file {default}", "env": "MESHD_CLUSTER",
    }  # fmt: skip
    # $MESHD_CONFIG names another file, which is read instead.
    other = _write(tmp_path / "other.toml", 'cluster = "other"\n')
    out = _show({**env, "MESHD_CONFIG": str(other)})
    assert out["settings"]["cluster"]["value"] == "other"


def test_a_named_config_file_that_is_missing_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    line = _error(_meshd(_env(tmp_path), "up", "--config", str(missing)))
    assert line == f"meshd: {missing}: no such config file"
    line = _error(_meshd(_env(tmp_path, MESHD_CONFIG=str(missing)), "config", "show"))
    assert line == f"meshd: {missing}: no such config file"


def test_the_api_key_is_shown_masked(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "meshd.toml", 'api_key = "sk-from-file"\n')
    out = _show(_env(tmp_path), "--config", str(cfg))
    assert out["settings"]["api_key"]["value"] == "****"
    r = _meshd(_env(tmp_path, MESHD_API_KEY="sk-from-env"), "config", "show", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "sk-from" not in r.stdout
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("api_key ")]
    assert line.split() == ["api_key", "****", "env", "MESHD_API_KEY"]


@pytest.mark.timeout(90)
def test_a_node_logs_json_lines_with_log_format_json(tmp_path: Path) -> None:
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    args = [
        sys.executable, "-m", "meshd.cli.meshd", "up", "--no-model", "--no-discovery",
        "--open", "--api-port", "0", "--mesh-host", "127.0.0.1", "--mesh-port", "0",
        "--data-dir", str(tmp_path / "data"), "--log-format", "json",
    ]  # fmt: skip
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=_env(tmp_path)
        )
    try:
        deadline = time.monotonic() + 60
        while "meshd ready" not in out_path.read_text():
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, err_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = err_path.read_text().splitlines()
    assert lines, "the node logged nothing"
    records = [json.loads(line) for line in lines]  # each line one JSON object
    for r in records:
        assert {"ts", "level", "logger", "msg"} <= r.keys(), r
        assert isinstance(r["ts"], float) and r["level"] in ("info", "warning", "error"), r
    assert any(r["logger"] == "meshd.node" for r in records), records


async def test_runners_log_as_their_node_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The supervisor tells a runner its node's log format; the runner (a real process,
    writing to the node's stderr) writes its lines in it. Its model is missing here: it
    logs why it could not load, in JSON."""
    monkeypatch.setattr(logs, "_CONFIGURED", ("info", "json"))
    settings = SupervisorSettings(
        cache_dir=tmp_path, bind_host="127.0.0.1", n_ctx=512, n_seq_max=2, stop_grace=2.0
    )
    sup = Supervisor(
        "a", settings, resolve_path=lambda m: str(tmp_path / "missing.gguf"),
        on_status=lambda: None,
    )  # fmt: skip
    try:
        await sup.reconcile({"x": inst("x", "a")})
        assert sup.runners[("x", 0)].config.log_format == "json"
        async with asyncio.timeout(45):
            while not any(s.state == "failed" for s in sup.statuses()):
                await asyncio.sleep(0.05)
    finally:
        await sup.stop_all()
    lines = [x for x in capfd.readouterr().err.splitlines() if '"proc"' in x]
    assert lines, "the runner logged nothing"
    record = json.loads(lines[0])
    assert record["proc"].startswith("runner ") and record["level"] == "error", record
    assert record["msg"] == "could not load the stage" and "exc" in record, record

"""``meshctl`` starts without the node's heavy libraries (issue 34: it starts in 0.3 s).

Every command is an HTTP request; none needs numpy, gguf, zmq, nacl or an engine, and
the argument parser needs neither httpx nor rich. Each command imports what it alone
needs when it runs. What is checked here is which modules are loaded, in a fresh
interpreter, not a time (CI machines are too noisy for one): a module-level import
that brings one of these back fails this test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]

#: Never loaded by ``import meshd.cli.meshctl`` nor by building its parser (``--help``).
HEAVY = (
    "numpy", "gguf", "zmq", "nacl", "spake2", "llama_cpp", "mlx", "mlx_lm",
    "huggingface_hub", "httpx", "rich", "starlette", "uvicorn", "meshd.transport.security",
    "meshd.api", "meshd.engines", "meshd.placement", "meshd.crdt", "meshd.node.config",
    "msgspec", "meshd.models.resolve",
)  # fmt: skip

_PROBE = """
import json, sys
import meshd.cli.meshctl as m
imported = sorted(sys.modules)
m.build_parser()
print(json.dumps({"import": imported, "parser": sorted(sys.modules)}))
"""


def _env() -> dict[str, str]:
    # This checkout's meshd, whatever is installed; no MESHCTL_/MESHD_ setting of the run.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHD_", "MESHCTL_"))}
    env["PYTHONPATH"] = str(REPO)
    return env


def _loaded(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in names)]


def test_import_and_parser_load_no_heavy_module() -> None:
    r = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=_env(), cwd=REPO,
        timeout=20, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert _loaded(got["import"], HEAVY) == []
    # msgspec comes with the parser only (the chat command's default model, in
    # meshd.models.resolve), never with the import.
    assert _loaded(got["import"], ("msgspec", "meshd.models")) == []
    assert _loaded(got["parser"], HEAVY) == []


def test_help_exits_0() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "--help"], capture_output=True, text=True,
        env=_env(), cwd=REPO, timeout=20, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: meshctl")
    for command in ("top", "nodes", "place", "chat", "secret", "pull"):
        assert command in r.stdout

"""API keys, the owner's credential and where the API listens, against a real `meshd up`
(its API key and admin key from files and the environment, never argv); another user
of the machine tries what the owner can do, with plain curl."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshd.cli.meshctl import main as meshctl
from meshd.node.owner import OWNER_FILE
from tests.cluster import Cluster, NodeProc, as_stranger, wait_for

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-0123456789abcdef"
ADMIN_KEY = "admin-test-fedcba9876543210"
NOBODY = 65534


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    """Node k: its API key in $MESHD_API_KEY, its admin key in a file, its data dir one
    that other users may enter (so that only the token file's own mode keeps them out)."""
    tmp = tmp_path_factory.mktemp("keyed")
    (tmp / "admin.key").write_text(ADMIN_KEY + "\n")
    (tmp / "admin.key").chmod(0o600)
    data = Path(tempfile.mkdtemp(prefix="meshd-keyed-"))
    data.chmod(0o755)
    try:
        with Cluster(tmp) as c:
            yield c.start(
                "k", data_dir=data / "k", env={"MESHD_API_KEY": KEY, "MESHD_ADMIN_KEY": ""},
                extra_args=["--admin-key-file", str(tmp / "admin.key")],
            )  # fmt: skip
    finally:
        shutil.rmtree(data, ignore_errors=True)


def _local(n: NodeProc) -> str:
    return n.api.replace("0.0.0.0", "127.0.0.1")


def test_a_key_opens_the_api_to_the_network_and_says_so(keyed: NodeProc) -> None:
    assert keyed.api.startswith("http://0.0.0.0:")
    assert "api http://0.0.0.0:" in keyed.log()
    assert KEY not in " ".join(keyed.args) and ADMIN_KEY not in " ".join(keyed.args)


def test_no_key_binds_loopback(tmp_path) -> None:
    with Cluster(tmp_path) as c:
        n = c.start("open")
        assert n.api.startswith("http://127.0.0.1:")


@pytest.mark.parametrize(
    "path,method", [("/v1/models", "GET"), ("/v1/cluster", "GET"), ("/metrics", "GET"),
                    ("/v1/chat/completions", "POST"), ("/v1/nope", "GET")],
)  # fmt: skip
def test_every_route_but_healthz_demands_the_key(keyed: NodeProc, path: str, method: str) -> None:
    url = _local(keyed) + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, url, headers=headers, json={}, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    ok = httpx.request(method, url, headers={"Authorization": f"Bearer {KEY}"}, json={}, timeout=10)
    assert ok.status_code != 401


def test_healthz_needs_no_key(keyed: NodeProc) -> None:
    assert httpx.get(_local(keyed) + "/healthz", timeout=5).status_code == 200


def test_openai_client_and_meshctl_use_the_key(
    keyed: NodeProc, capsys, monkeypatch, tmp_path: Path
) -> None:
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=_local(keyed) + "/v1", api_key=KEY, timeout=10)
    assert isinstance(good.models.list().data, list)
    bad = openai.OpenAI(base_url=_local(keyed) + "/v1", api_key="nope", timeout=10, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    node = _local(keyed).removeprefix("http://")
    monkeypatch.delenv("MESHD_ADMIN_KEY")
    monkeypatch.setenv("MESHD_DATA_DIR", str(tmp_path))  # no owner token there
    assert meshctl(["--node", node, "nodes", "--json"]) == 1
    (tmp_path / "key").write_text(KEY)
    (tmp_path / "key").chmod(0o600)
    assert meshctl(["--node", node, "--api-key-file", str(tmp_path / "key"), "nodes"]) == 0
    monkeypatch.setenv("MESHD_API_KEY", KEY)
    assert meshctl(["--node", node, "nodes", "--json"]) == 0
    assert '"k"' in capsys.readouterr().out
    # The API key reads; it does not administer.
    with as_stranger():
        assert meshctl(["--node", node, "invite"]) == 1
    assert "opens inference only" in capsys.readouterr().err


def test_the_inference_key_administers_nothing_the_admin_key_does(keyed: NodeProc) -> None:
    url = _local(keyed)
    with as_stranger():
        for r in (
            httpx.post(url + "/v1/invites", headers={"Authorization": f"Bearer {KEY}"}),
            httpx.post(url + "/v1/instances", headers={"x-api-key": KEY}, json={"model": "m"}),
            httpx.post(url + "/api/pull", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "m"}),
        ):  # fmt: skip
            assert r.status_code == 403, r.text
        assert "meshctl" in r.json()["error"]  # Ollama's shape
        r = httpx.post(url + "/v1/invites", headers={"x-meshd-admin": ADMIN_KEY})
        assert r.status_code == 201 and r.json()["code"]
    log = wait_for(lambda: "by admin key from 127.0.0.1: 201" in keyed.log() and keyed.log(), 5)
    assert "POST /v1/invites refused (admin_required) from 127.0.0.1: 403" in log


def test_the_owner_runs_meshctl_with_no_flag(keyed: NodeProc, capsys, monkeypatch) -> None:
    token = keyed.data_dir / OWNER_FILE
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    monkeypatch.delenv("MESHD_ADMIN_KEY")
    monkeypatch.setenv("MESHD_DATA_DIR", str(keyed.data_dir))
    node = _local(keyed).removeprefix("http://")
    with as_stranger():  # what meshctl sends, no more
        assert meshctl(["--node", node, "invite", "--json"]) == 0, capsys.readouterr().err
        assert '"code"' in capsys.readouterr().out
        assert meshctl(["--node", node, "members", "--json"]) == 0  # and reads, without the key
    assert "POST /v1/invites by owner from 127.0.0.1: 201" in keyed.log()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_another_user_of_the_machine_reads_no_token_and_administers_nothing(
    keyed: NodeProc,
) -> None:
    def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, user=NOBODY, group=NOBODY, extra_groups=[], text=True,
            capture_output=True, timeout=30, env={"PATH": os.defpath},
        )  # fmt: skip

    token = keyed.data_dir / OWNER_FILE
    assert as_nobody("ls", str(keyed.data_dir)).returncode != 0  # the data dir is 0700...
    assert stat.S_IMODE(token.stat().st_mode) == 0o600  # ...and the token 0600 in it
    r = as_nobody("cat", str(token))
    assert r.returncode != 0 and "Permission denied" in r.stderr and not r.stdout
    url = _local(keyed)
    curl = ("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
            "Content-Type: application/json")  # fmt: skip
    place = '{"model": "smollm2-135m", "nodes": ["k"]}'
    assert as_nobody(*curl, "-X", "POST", url + "/v1/invites").stdout == "401"
    assert as_nobody(*curl, "-d", place, url + "/v1/instances").stdout == "401"
    # A household member who was given the inference key still administers nothing.
    bearer = ("-H", f"Authorization: Bearer {KEY}")
    assert as_nobody(*curl, *bearer, "-X", "POST", url + "/v1/invites").stdout == "403"
    assert as_nobody(*curl, *bearer, "-d", place, url + "/v1/instances").stdout == "403"
    assert as_nobody(*curl, *bearer, url + "/v1/models").stdout == "200"
    log = keyed.log()
    assert "POST /v1/instances refused (admin_required) from 127.0.0.1: 401" in log
    assert "POST /v1/instances by" not in log

"""API keys and where the API listens, against a real `meshd up`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from meshd.cli.meshctl import main as meshctl
from tests.cluster import Cluster, NodeProc

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProc]:
    with Cluster(tmp_path_factory.mktemp("keyed")) as c:
        yield c.start("k", extra_args=["--api-key", KEY])


def _local(n: NodeProc) -> str:
    return n.api.replace("0.0.0.0", "127.0.0.1")


def test_a_key_opens_the_api_to_the_network_and_says_so(keyed: NodeProc) -> None:
    assert keyed.api.startswith("http://0.0.0.0:")
    assert "api http://0.0.0.0:" in keyed.log()


def test_no_key_binds_loopback(tmp_path) -> None:
    with Cluster(tmp_path) as c:
        n = c.start("open")
        assert n.api.startswith("http://127.0.0.1:")


@pytest.mark.parametrize(
    "path,method", [("/v1/models", "GET"), ("/v1/cluster", "GET"), ("/metrics", "GET"),
                    ("/v1/chat/completions", "POST"), ("/v1/instances", "POST"),
                    ("/v1/nope", "GET")],
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


def test_openai_client_and_meshctl_use_the_key(keyed: NodeProc, capsys, monkeypatch) -> None:
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=_local(keyed) + "/v1", api_key=KEY, timeout=10)
    assert isinstance(good.models.list().data, list)
    bad = openai.OpenAI(base_url=_local(keyed) + "/v1", api_key="nope", timeout=10, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    node = _local(keyed).removeprefix("http://")
    assert meshctl(["--node", node, "nodes", "--json"]) == 1
    assert meshctl(["--node", node, "--api-key", KEY, "nodes", "--json"]) == 0
    monkeypatch.setenv("MESHD_API_KEY", KEY)
    assert meshctl(["--node", node, "nodes", "--json"]) == 0
    assert '"k"' in capsys.readouterr().out

"""`meshd up` serves the default model with no flags; requests place models on demand."""

from __future__ import annotations

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(180)


def _instances(n) -> list[dict]:
    return n.get("/v1/instances")["data"]


def test_nodes_starting_at_once_end_with_one_instance_of_the_default_model(
    cluster: Cluster,
) -> None:
    a = cluster.start("a", model=DEFAULT_MODEL)
    b = cluster.start("b", peers=[a], model=DEFAULT_MODEL, wait=False)
    c = cluster.start("c", peers=[a], model=DEFAULT_MODEL, wait=False)
    cluster.wait_ready(b)
    cluster.wait_ready(c)
    nodes = [a, b, c]

    def one_ready_everywhere() -> bool:
        views = [_instances(n) for n in nodes]
        return all(
            len(v) == 1 and v[0]["model"] == DEFAULT_MODEL
            and all(s["state"] == "ready" for s in v[0]["stages"])
            for v in views
        )  # fmt: skip

    wait_for(one_ready_everywhere, 60, interval=0.25)
    r = httpx.post(
        c.api + "/v1/chat/completions",
        json={"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 8, "temperature": 0},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    # Still exactly one a while later: no node re-placed it after the fact.
    assert all(len(_instances(n)) == 1 for n in nodes)


def test_a_request_for_a_known_model_with_no_instance_places_it_and_waits(
    cluster: Cluster,
) -> None:
    a = cluster.start("a")
    assert _instances(a) == []
    r = httpx.post(
        a.api + "/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": "The sky is", "max_tokens": 4,
              "temperature": 0},
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert [i["model"] for i in _instances(a)] == [DEFAULT_MODEL]


def test_unknown_model_and_bad_bodies_get_openai_errors_and_change_nothing(
    cluster: Cluster,
) -> None:
    a = cluster.start("a")
    r = httpx.post(a.api + "/v1/chat/completions",
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
                   timeout=30)  # fmt: skip
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(a.api + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(a.api + "/v1/chat/completions", json={"model": DEFAULT_MODEL}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(a.api + "/v1/instances", json={"model": "no-such-model"}, timeout=30)
    assert r.status_code == 404
    assert _instances(a) == []

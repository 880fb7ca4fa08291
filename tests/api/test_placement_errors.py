"""A model the cluster cannot hold: a typed 503 at once, no Retry-After, nothing placed."""

from __future__ import annotations

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster

pytestmark = pytest.mark.timeout(60)


def test_a_model_too_big_for_the_cluster_is_a_typed_503_without_retry_after(
    cluster: Cluster,
) -> None:
    n = cluster.start("tiny", extra_args=["--max-memory", "1M"])
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(n.api + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_memory"
    assert "tiny" in err["message"]  # says which node falls short
    # Waiting a second changes nothing here: a client must not be told to retry soon.
    assert "retry-after" not in r.headers
    assert n.get("/v1/instances")["data"] == []

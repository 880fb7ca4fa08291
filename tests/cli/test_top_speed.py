"""``meshctl top`` shows speed: the node's window of its requests (``meshd.node.speed``),
the figures the node adds up from the heartbeats for its instance view (and top shows),
and a live cluster streaming."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest
from rich.console import Console

from meshd.cli.top import render, snapshot
from meshd.models.resolve import DEFAULT_MODEL
from meshd.node.speed import RATE_WINDOW_S, WINDOW_S, Speed
from tests.cli.test_top_render import CLUSTER, NOW_MS, A, B, instances_of
from tests.cluster import Cluster, wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_window_gives_rates_medians_and_forgets_old_samples() -> None:
    clock = Clock()
    s = Speed(clock)
    s.began("m")
    s.token("m", 1, ttft=0.2, stages=[0.010, 0.020])
    for i in range(19):
        clock.t += 0.1
        s.token("m", 1, itl=0.1, stages=[0.010 + i * 0.001, 0.020], hop=0.002)
    tps, models = s.summary()
    assert tps == pytest.approx(20 / 1.9, abs=0.01)  # over the stream's own span so far
    m = models["m"]
    assert m.in_flight == 1 and m.ttft_ms == 200.0 and m.itl_ms == pytest.approx(100.0)
    assert m.stage_ms == [pytest.approx(18.5, abs=1), 20.0] and m.hop_ms == 2.0
    s.ended("m")
    clock.t += RATE_WINDOW_S + 1  # the rate is short-term, the medians a minute long
    tps, models = s.summary()
    assert tps == 0 and models["m"].ttft_ms == 200.0 and models["m"].in_flight == 0
    clock.t += WINDOW_S
    assert s.summary() == (0.0, {})  # idle for a minute: nothing to say


def _serving() -> dict:
    cluster = copy.deepcopy(CLUSTER)
    iid = CLUSTER["instances"][0]["id"]
    cluster["nodes"][0]["health"] |= {"tokens_s": 30.0, "serving": {iid: {
        "tokens_s": 30.0, "in_flight": 2, "ttft_ms": 120.0, "itl_ms": 33.0,
        "stage_ms": [12.5, 9.0, 4.0], "hop_ms": 1.5}}}  # fmt: skip
    cluster["nodes"][1]["health"] |= {"tokens_s": 10.0, "serving": {iid: {
        "tokens_s": 10.0, "in_flight": 1, "ttft_ms": 200.0, "itl_ms": 41.0,
        "stage_ms": [14.5, 9.0, 4.0], "hop_ms": 2.5}}}  # fmt: skip
    runners = cluster["nodes"][0]["health"]["runners"]
    runners[0] |= {"active": 3, "waiting": 5, "stage": 0}
    return cluster


def test_an_instance_adds_up_what_every_node_measured() -> None:
    cluster = _serving()
    (view,) = instances_of(cluster)
    s = view["speed"]
    assert s["tokens_s"] == 40.0 and s["in_flight"] == 3
    assert s["busy"] == 3 and s["queue"] == 5
    # medians weighted by each node's tokens/s
    assert s["ttft_ms"] == pytest.approx((120 * 30 + 200 * 10) / 40)
    assert view["stages"][0]["ms_per_token"] == pytest.approx((12.5 * 30 + 14.5 * 10) / 40)
    assert s["hop_ms"] == pytest.approx(1.75)
    # One request's speed as measured: 1000 / the median time between tokens.
    assert view["measured_tokens_s"] == round(1000 / 37, 2)
    snap = snapshot(cluster, [view])
    assert json.loads(json.dumps(snap)) == snap
    (inst,) = snap["instances"]
    assert inst["tokens_s"] == 40.0 and inst["stages"][1]["ms_per_token"] == 9.0
    assert {n["id"]: n["tokens_s"] for n in snap["nodes"]}[A] == 30.0
    assert {n["id"]: n["in_flight"] for n in snap["nodes"]}[B] == 1


def test_two_instances_of_one_model_show_their_own_figures() -> None:
    # A second instance of the same model, on one node: its requests went at another
    # speed. Each view adds up its own instance's figures, not the model's.
    cluster = _serving()
    first = cluster["instances"][0]
    cluster["instances"].append(
        {
            **copy.deepcopy(first),
            "id": "second",
            "stages": [
                {"node": B, "start": 0, "end": first["stages"][-1]["end"], "engine": "llama_cpp"}
            ],
        }
    )
    cluster["nodes"][1]["health"]["serving"]["second"] = {
        "tokens_s": 5.0,
        "in_flight": 1,
        "ttft_ms": 900.0,
        "itl_ms": 200.0,
        "stage_ms": [190.0],
    }
    views = {v["id"]: v for v in instances_of(cluster)}
    one, two = views[first["id"]], views["second"]
    assert (one["speed"]["tokens_s"], two["speed"]["tokens_s"]) == (40.0, 5.0)
    assert (one["speed"]["in_flight"], two["speed"]["in_flight"]) == (3, 1)
    assert two["speed"]["ttft_ms"] == 900.0 and two["speed"]["itl_ms"] == 200.0
    assert one["speed"]["ttft_ms"] == pytest.approx((120 * 30 + 200 * 10) / 40)
    assert two["measured_tokens_s"] == 5.0 and one["measured_tokens_s"] == round(1000 / 37, 2)
    rows = {i["id"]: i for i in snapshot(cluster, list(views.values()))["instances"]}
    assert rows["second"]["tokens_s"] == 5.0 and rows[first["id"]]["tokens_s"] == 40.0


@pytest.mark.parametrize("width", [80, 160])
def test_the_speed_columns_fit_the_terminal(width: int) -> None:
    console = Console(record=True, width=width, file=io.StringIO())
    cluster = _serving()
    console.print(render(cluster, instances_of(cluster), NOW_MS))
    text = console.export_text()
    assert all(len(line) <= width for line in text.splitlines())
    assert "40.0" in text  # the instance's tokens/s
    assert "12.5 ms" in text or "13.0 ms" in text  # stage 0's ms per token
    if width >= 160:
        assert "140 ms" in text and "hop 1.8 ms" in text  # ttft and the hop


def _meshctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", *args],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


@pytest.mark.timeout(240)
def test_top_shows_the_speed_of_a_live_stream(cluster: Cluster) -> None:
    a = cluster.start("alpha")
    b = cluster.start("bravo", peers=[a])
    wait_for(lambda: len(b.cluster()["nodes"]) == 2, 15)
    r = httpx.post(a.api + "/v1/instances", timeout=60,
                   json={"model": DEFAULT_MODEL, "nodes": ["alpha", "bravo"]})  # fmt: skip
    assert r.status_code == 201, r.text
    iid = r.json()["id"]
    wait_for(lambda: all(s["state"] == "ready" for s in a.get(f"/v1/instances/{iid}")["stages"]),
             120, 0.2)  # fmt: skip
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True}  # fmt: skip
    done, enough = threading.Event(), threading.Event()

    def stream() -> None:
        with httpx.stream("POST", a.api + "/v1/chat/completions", json=body, timeout=120) as s:
            for _ in s.iter_lines():
                if enough.is_set():
                    break  # the client goes away: the node cancels the request
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    node = a.api.removeprefix("http://")
    seen: dict = {}

    def busy() -> bool:
        r = _meshctl("--node", node, "top", "--json")
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)
        inst = next(i for i in snap["instances"] if i["id"] == iid)
        me = next(n for n in snap["nodes"] if n["name"] == "alpha")
        seen.update(inst=inst, node=me)
        return (
            inst["tokens_s"] > 0 and me["tokens_s"] > 0 and inst["in_flight"] == 1
            and inst["ttft_ms"] and inst["itl_ms"]
            and all(st["ms_per_token"] for st in inst["stages"])
        )  # fmt: skip

    try:
        wait_for(busy, 60, 0.5)
    except TimeoutError:
        raise AssertionError(f"top never showed the stream: {seen}") from None
    assert seen["inst"]["ttft_ms"] and seen["inst"]["itl_ms"], seen
    # Placement's figures are real: each node timed its stage's decode steps, and
    # alpha its round trip to bravo; the prediction for one request is shown beside
    # what was measured, and on one machine lands within a few times of it.
    snaps: list = []

    def timed_rtt() -> bool:
        # The round trip comes from alpha's mesh requests to bravo, which the stream
        # need not have waited for; it is in alpha's next heartbeat after the first.
        snaps.append(json.loads(_meshctl("--node", node, "top", "--json").stdout))
        bravo = next(n["id"] for n in snaps[-1]["nodes"] if n["name"] == "bravo")
        me = next(n for n in snaps[-1]["nodes"] if n["name"] == "alpha")
        return bravo in me["rtt_ms"]

    try:
        wait_for(timed_rtt, 30, 1.0)
    except TimeoutError:
        raise AssertionError(f"alpha never timed its round trip to bravo: {snaps[-1:]}") from None
    snap = snaps[-1]
    bravo = next(n["id"] for n in snap["nodes"] if n["name"] == "bravo")
    for n in snap["nodes"]:
        assert n["decode_bps"] > 1e8, n
    me = next(n for n in snap["nodes"] if n["name"] == "alpha")
    assert 0 < me["rtt_ms"][bravo] < 100, me
    inst = next(i for i in snap["instances"] if i["id"] == iid)
    assert inst["predicted_tokens_s"] > 0, inst
    # (The link's bandwidth comes with a probe a few pulls later, and with it the
    # prompt's transfer: tests/node/test_round_trips.py waits for that one.)
    assert inst["predicted_transfer_s"] >= 0, inst
    # The runners report their live figures every few seconds: the prediction comes
    # within a few times of the measured speed (the load-time timing is noisier).
    figures: list = []

    def close() -> bool:
        listed = a.get(f"/v1/instances/{iid}")
        pred, real = listed["predicted_tokens_s"], listed["measured_tokens_s"]
        figures.append((pred, real))
        return pred > 0 and real > 0 and real / 4 < pred < real * 4

    try:
        wait_for(close, 30, 1.0)
    except TimeoutError:
        raise AssertionError(f"predicted vs measured tok/s: {figures}") from None
    print(f"one request, predicted vs measured tok/s: {figures}")
    # The frame a person sees, at 80 and 160 columns, as tmux draws it.
    for width in (80, 160):
        r = subprocess.run(
            [sys.executable, "-m", "meshd.cli.meshctl", "--node", node, "top", "--once"],
            capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": str(width)},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert all(len(line) <= width for line in r.stdout.splitlines()), r.stdout
        assert " ms" in r.stdout and "tok/s" in r.stdout
    if shutil.which("tmux"):
        _tmux_frame(node, 80)
    enough.set()
    assert done.wait(30)


def _tmux_frame(node: str, width: int) -> None:
    """Draw one frame in a detached tmux pane ``width`` wide and read the pane back."""
    name = f"meshd-top-{time.monotonic_ns()}"
    cmd = f"{sys.executable} -m meshd.cli.meshctl --node {node} top --once; sleep 30"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", str(width), "-y", "60", cmd],
                   check=True, timeout=10)  # fmt: skip
    try:
        text = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "instances" not in text:
            time.sleep(0.5)
            text = subprocess.run(["tmux", "capture-pane", "-p", "-t", name],
                                  capture_output=True, text=True, timeout=10).stdout  # fmt: skip
        assert "instances" in text, text
        assert all(len(line) <= width for line in text.splitlines())
        assert "tok/s" in text
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], timeout=10, check=False)

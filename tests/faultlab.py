"""Kill-a-stage trials shared by the fault test and bench/faults.py."""

from __future__ import annotations

import json
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

import httpx

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for, wait_serving

#: The prompt of every greedy stream a fault test compares with an uninterrupted one.
#: A replay feeds the tokens the client has one row a step, as a plain answer made
#: them, but a speculating answer made them in batched steps (whose shapes follow the
#: drafts and the timing), and llama.cpp's batched rows are not bit-identical to one-row
#: steps: at a near tie the texts part with nothing lost, as speculation's own greedy
#: text may part from plain greedy (docs/architecture.md). SmolLM2-135M's greedy story
#: ("Tell a story.") has top-two logit gaps down to 0.008 and four argmax flips between
#: batched and one-row decodes in its first 100 tokens (CI once saw "Lost" become
#: "Last" after a kill). Counting keeps every gap in 300 tokens at 0.47 or more with no
#: flips, and a lost or repeated token shows as a skipped or repeated number.
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


@dataclass
class Trial:
    """What one SIGKILL of the middle stage's node did."""

    outcome: str  # "continued" | "error" | "hang"
    detected_s: float  # SIGKILL -> the API node marks the node dead (runner: stage not ready)
    ended_or_resumed_s: float  # SIGKILL -> error event, or first token after the gap
    serving_s: float  # SIGKILL -> the repaired instance is ready
    text_ok: bool
    suspect_s: float = float("nan")  # SIGKILL -> the API node suspects the node


def stream(
    via: NodeProc, events: list[tuple[float, str]], max_tokens: int, **sampling: object
) -> None:
    """Stream a completion, greedy and exact unless ``sampling`` says otherwise (a
    replay must give the uninterrupted text token for token); append (time, SSE line)
    to ``events``."""
    body = {"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "exact": True,
            **sampling}  # fmt: skip
    with httpx.stream("POST", via.api + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line))


def text_of(events: list[tuple[float, str]]) -> str:
    out = []
    for _, line in events:
        if line.startswith("data: {"):
            ev = json.loads(line[6:])
            out += [c.get("text", "") for c in ev.get("choices") or []]
    return "".join(out)


def place(via: NodeProc, nodes: list[NodeProc]) -> dict:
    r = httpx.post(
        via.api + "/v1/instances",
        json={"model": DEFAULT_MODEL, "nodes": [n.name for n in nodes]},
        timeout=60,
    )
    r.raise_for_status()
    inst = r.json()
    wait_serving(via, inst["id"], 60)
    return inst


def three_nodes(cluster: Cluster) -> list[NodeProc]:
    """Nodes a, b, c on loopback, each seeing the others."""
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    c = cluster.start("c", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 3 for n in (a, b, c)), 10)
    return [a, b, c]


def clear(cluster: Cluster, nodes: list[NodeProc]) -> list[NodeProc]:
    """``nodes`` all up and serving nothing: a node a kill or a drain left down is
    restarted (under the same id, in its place in ``nodes``), every instance removed."""
    down = [k for k, n in enumerate(nodes) if not n.alive()]
    for k in down:
        nodes[k] = cluster.restart(nodes[k])
    a = nodes[0]
    if down:
        wait_for(lambda: all(a.liveness().get(n.name) == "alive" for n in nodes[1:]), 20, 0.05)
    for i in a.get("/v1/instances")["data"]:
        httpx.delete(f"{a.api}/v1/instances/{i['id']}", timeout=10)
    return nodes


def fresh_plan(cluster: Cluster, nodes: list[NodeProc], reuse: bool = False) -> dict:
    """A new instance on ``nodes`` in stage order, every stage ready, on :func:`clear`
    nodes.

    ``reuse``: keep the one instance there if nothing has touched its plan yet (its
    first generation, on these nodes, ready, every node up): a test's reference stream
    may share it with the stream it kills. Each kill needs a plan of its own otherwise
    (and a runner's restarts count towards its crash-loop breaker)."""
    a = nodes[0]
    old = a.get("/v1/instances")["data"] if reuse else []
    if len(old) == 1 and all(n.alive() for n in nodes):
        v, ids = a.get(f"/v1/instances/{old[0]['id']}"), [n.node_id for n in nodes]
        untouched = v["generation"] == 1 and [s["node"] for s in v["stages"]] == ids
        if untouched and all(s["state"] == "ready" for s in v["stages"]):
            return v
    return place(a, clear(cluster, nodes))


def uninterrupted(via: NodeProc, n_tokens: int, **sampling: object) -> str:
    """The text of an uninterrupted stream (see :func:`stream`), checked whole."""
    events: list[tuple[float, str]] = []
    stream(via, events, n_tokens, **sampling)
    assert events and events[-1][1] == "data: [DONE]", events[-3:]
    assert not any('"error"' in line for _, line in events), events[-3:]
    return text_of(events)


def three_nodes_and_reference(cluster: Cluster, n_tokens: int) -> tuple[list[NodeProc], str]:
    """Nodes a, b, c on loopback and the uninterrupted greedy text of an ``n_tokens``
    stream through a 3-stage [a, b, c] plan (placed and streamed once: each trial places
    its own)."""
    nodes = three_nodes(cluster)
    fresh_plan(cluster, nodes)
    return nodes, uninterrupted(nodes[0], n_tokens)


def _watch(
    a: NodeProc, inst_id: str, killed: float, marks: dict[str, float], checks: dict
) -> threading.Thread:
    """Poll ``a`` beside the stream, so each mark is when it happened, not when we looked:
    ``checks`` maps a mark name to a predicate of (liveness by name, instance view)."""

    def run() -> None:
        deadline = killed + 60
        while time.monotonic() < deadline and len(marks) < len(checks):
            try:
                live, view = a.liveness(), a.get(f"/v1/instances/{inst_id}")
                for name, check in checks.items():
                    if name not in marks and check(live, view):
                        marks[name] = time.monotonic()
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(0.02)

    w = threading.Thread(target=run, daemon=True)
    w.start()
    return w


#: A silence this long in a stream after the kill is the gap the kill made.
GAP_S = 0.3


def _ended(
    events: list[tuple[float, str]], killed: float, reference: str
) -> tuple[str, float, bool]:
    """Outcome, SIGKILL -> error event or first token after the gap, and text check.

    Tokens already on their way when the node died still arrive just after the kill:
    the resume is the first event after a silence of :data:`GAP_S` or more."""
    after = [(ts, line) for ts, line in events if ts > killed]
    errored = any('"error"' in line for _, line in after)
    first_after = float("inf")
    prev = killed
    for ts, line in after:
        if '"error"' in line or ts - prev >= GAP_S:
            first_after = ts - killed
            break
        prev = ts
    ok = errored or text_of(events) == reference
    return ("error" if errored else "continued"), first_after, ok


def kill_middle(
    cluster: Cluster, nodes: list[NodeProc], reference: str, n_tokens: int, after: int = 10
) -> Trial:
    """Place [a, victim, c], stream from a, SIGKILL the victim once ``after`` events
    came, measure."""
    inst = fresh_plan(cluster, nodes)
    a, victim = nodes[0], nodes[1]
    events: list[tuple[float, str]] = []
    t = threading.Thread(target=stream, args=(a, events, n_tokens), daemon=True)
    t.start()
    wait_for(lambda: len(events) >= after, 30, interval=0.01)
    victim.kill()
    killed = time.monotonic()
    marks: dict[str, float] = {}
    w = _watch(a, inst["id"], killed, marks, {
        "suspect": lambda live, v: live.get(victim.name) in ("suspect", "dead"),
        "detected": lambda live, v: live.get(victim.name) == "dead",
        "served": lambda live, v: v["generation"] >= 2
        and all(s["state"] == "ready" for s in v["stages"]),
    })  # fmt: skip
    t.join(90)
    w.join(60)
    detected = marks.get("detected", float("inf"))
    served = marks.get("served", float("inf"))
    suspect = marks.get("suspect", float("inf"))
    if t.is_alive():
        return Trial("hang", detected - killed, float("inf"), float("inf"), False)
    outcome, first_after, ok = _ended(events, killed, reference)
    # The victim comes back under the same id with the next plan (fresh_plan).
    return Trial(outcome, detected - killed, first_after, served - killed, ok, suspect - killed)


def runner_pids(instance: str, stage: int | None = None) -> list[int]:
    """Pids of the runner processes of ``instance`` (of one stage if given)."""
    pattern = f"meshd.engines.runner.*{instance}"
    if stage is not None:  # argv: ... -m meshd.engines.runner INSTANCE STAGE
        pattern += f" {stage}$"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def kill_runner(cluster: Cluster, nodes: list[NodeProc], reference: str, n_tokens: int) -> Trial:
    """Place [a, b, c], stream from a, SIGKILL only b's runner (b stays up), measure.

    ``detected``: the stage stops being ready; ``served``: it is ready again."""
    import os
    import signal

    inst = fresh_plan(cluster, nodes)
    a = nodes[0]
    (pid,) = runner_pids(inst["id"], stage=1)
    events: list[tuple[float, str]] = []
    t = threading.Thread(target=stream, args=(a, events, n_tokens), daemon=True)
    t.start()
    wait_for(lambda: len(events) >= 10, 30, interval=0.01)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    marks: dict[str, float] = {}

    def back(live: dict, v: dict) -> bool:
        return "detected" in marks and all(s["state"] == "ready" for s in v["stages"])

    w = _watch(a, inst["id"], killed, marks, {
        "detected": lambda live, v: any(s["state"] != "ready" for s in v["stages"]),
        "served": back,
    })  # fmt: skip
    t.join(90)
    w.join(60)
    detected = marks.get("detected", float("inf"))
    served = marks.get("served", float("inf"))
    if t.is_alive():
        return Trial("hang", detected - killed, float("inf"), float("inf"), False)
    outcome, first_after, ok = _ended(events, killed, reference)
    return Trial(outcome, detected - killed, first_after, served - killed, ok)


def summary(trials: list[Trial]) -> str:
    """Median and max of each figure, and the outcomes."""

    def mm(xs: list[float]) -> str:
        if not xs:
            return "-"
        return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s"

    lines = [
        f"trials: {len(trials)}; continued: {sum(t.outcome == 'continued' for t in trials)}, "
        f"typed error: {sum(t.outcome == 'error' for t in trials)}, "
        f"hangs: {sum(t.outcome == 'hang' for t in trials)}, "
        f"wrong text: {sum(not t.text_ok for t in trials)}",
        *(
            [f"(a) SIGKILL -> node suspect:          {mm([t.suspect_s for t in trials])}"]
            if all(t.suspect_s == t.suspect_s for t in trials)  # not NaN: measured
            else []
        ),
        f"(a) SIGKILL -> death detected:        {mm([t.detected_s for t in trials])}",
        f"(b) SIGKILL -> stream resumed/ended:  {mm([t.ended_or_resumed_s for t in trials])}",
        f"(c) SIGKILL -> instance serving:      {mm([t.serving_s for t in trials])}",
    ]
    return "\n".join(lines)

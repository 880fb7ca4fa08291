"""Kill-a-stage trials shared by the fault test and bench/faults.py."""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass

import httpx

from meshd.engines.models import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for


@dataclass
class Trial:
    """What one SIGKILL of the middle stage's node did."""

    outcome: str  # "continued" | "error" | "hang"
    detected_s: float  # SIGKILL -> the API node marks the node dead
    ended_or_resumed_s: float  # SIGKILL -> error event, or first token after the gap
    serving_s: float  # SIGKILL -> the repaired instance is ready
    text_ok: bool


def stream(via: NodeProc, events: list[tuple[float, str]], max_tokens: int) -> None:
    """Stream a greedy completion; append (time, SSE line) to ``events``."""
    body = {"model": DEFAULT_MODEL, "prompt": "Tell a story.", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
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
    wait_for(lambda: all(s["state"] == "ready"
                         for s in via.get(f"/v1/instances/{inst['id']}")["stages"]),
             60, interval=0.1)  # fmt: skip
    return inst


def kill_middle(cluster: Cluster, nodes: list[NodeProc], reference: str, n_tokens: int) -> Trial:
    """Place [a, victim, c], stream from a, SIGKILL the victim mid-stream, measure, restart."""
    a, victim, c = nodes
    for i in a.get("/v1/instances")["data"]:
        httpx.delete(f"{a.api}/v1/instances/{i['id']}", timeout=10)
    inst = place(a, [a, victim, c])
    events: list[tuple[float, str]] = []
    t = threading.Thread(target=stream, args=(a, events, n_tokens), daemon=True)
    t.start()
    wait_for(lambda: len(events) >= 10, 30, interval=0.01)
    victim.kill()
    killed = time.monotonic()
    marks: dict[str, float] = {}

    def watch() -> None:
        # Polled beside the stream, so each time is when it happened, not when we looked.
        deadline = killed + 60
        while time.monotonic() < deadline and len(marks) < 2:
            try:
                if "detected" not in marks and a.liveness().get(victim.name) == "dead":
                    marks["detected"] = time.monotonic()
                v = a.get(f"/v1/instances/{inst['id']}")
                if (
                    "served" not in marks
                    and v["generation"] >= 2
                    and all(s["state"] == "ready" for s in v["stages"])
                ):
                    marks["served"] = time.monotonic()
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(0.02)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    t.join(90)
    w.join(60)
    detected = marks.get("detected", float("inf"))
    served = marks.get("served", float("inf"))
    if t.is_alive():
        return Trial("hang", detected - killed, float("inf"), float("inf"), False)
    after = [(ts, line) for ts, line in events if ts > killed]
    errored = any('"error"' in line for _, line in after)
    # The first token after the gap the kill made (or the error event).
    first_after = next(
        (ts - killed for ts, line in after if '"error"' in line or ts - killed > 0.05),
        float("inf"),
    )
    outcome = "error" if errored else "continued"
    ok = errored or text_of(events) == reference
    # Bring the victim back under the same id for the next trial.
    back = cluster.restart(victim)
    nodes[1] = back
    wait_for(lambda: a.liveness().get(back.name) == "alive", 20, interval=0.05)
    return Trial(outcome, detected - killed, first_after, served - killed, ok)


def summary(trials: list[Trial]) -> str:
    """Median and max of each figure, and the outcomes."""

    def mm(xs: list[float]) -> str:
        return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s"

    lines = [
        f"trials: {len(trials)}; continued: {sum(t.outcome == 'continued' for t in trials)}, "
        f"typed error: {sum(t.outcome == 'error' for t in trials)}, "
        f"hangs: {sum(t.outcome == 'hang' for t in trials)}, "
        f"wrong text: {sum(not t.text_ok for t in trials)}",
        f"(a) SIGKILL -> death detected:        {mm([t.detected_s for t in trials])}",
        f"(b) SIGKILL -> stream resumed/ended:  {mm([t.ended_or_resumed_s for t in trials])}",
        f"(c) SIGKILL -> instance serving:      {mm([t.serving_s for t in trials])}",
    ]
    return "\n".join(lines)

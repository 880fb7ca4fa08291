"""Stages that fail without dying, end to end.

A stage whose output is corrupt is failed over: two real nodes run the runners' fault
drill ($MESHD_FAULT_INJECT, meshd.engines.guard), one making NaN and one huge finite
values. The stream goes on with nothing lost on a plan without them; each node gives
its runner up, with the reason shown and the fault counted in /metrics; no error
reaches the client, and none is blamed on it.

A stage that stops (SIGSTOP: alive, silent) is found stalled by its node within
seconds (meshd.node.watchdog), ended and started again, and the stream resumes with
nothing lost, long before the pipeline's silence timeout."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from meshd.engines.guard import FAULT_ENV
from meshd.node.watchdog import SILENCE_S
from tests import faultlab
from tests.cluster import Cluster, metric_total, wait_for, wait_serving

pytestmark = pytest.mark.timeout(240)

N_TOKENS = 80
#: Stall found (SILENCE_S), the runner restarted (0.5 s back-off, ~1 s load), the
#: request replayed: what a stopped stage costs a stream, with room for a busy machine.
STALL_BOUND_S = SILENCE_S + 3.0


def test_corrupt_stages_are_failed_over_and_the_stream_completes(cluster: Cluster) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a], env={FAULT_ENV: "nan@15"})
    c = cluster.start("c", peers=[a], env={FAULT_ENV: "huge@40"})
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 3 for n in (a, b, c)), 10)
    inst = faultlab.place(a, [a, b, c])
    events: list[tuple[float, str]] = []
    t = threading.Thread(target=faultlab.stream, args=(a, events, N_TOKENS), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and events[-1][1] == "data: [DONE]", events[-3:]
    assert not any('"error"' in line for _, line in events), [e for e in events if "error" in e[1]]
    # The prompt counts to 10: every number after it, once, in order (a lost or
    # repeated token would show as a skipped or repeated number).
    numbers = [int(x) for x in re.findall(r"\d+", faultlab.text_of(events))]
    assert numbers == list(range(11, 11 + len(numbers))) and len(numbers) >= 20, numbers

    view = a.get(f"/v1/instances/{inst['id']}")
    excluded = {x["node"]: x["reason"] for x in view["excluded"]}
    assert set(excluded) == {b.node_id, c.node_id}, excluded
    assert "NaN" in excluded[b.node_id] and "past the bound" in excluded[c.node_id]
    assert all(r.startswith("faulty output: ") for r in excluded.values())
    assert {s["node"] for s in view["stages"]} == {a.node_id}
    for n in (b, c):
        assert metric_total(n, "meshd_stage_faults_total") == 1
    # Each replay says why: the fault's own error, or its stage seen failed first (the
    # runner's node beats at once; either may reach a first).
    replays = [ln for ln in a.log().splitlines() if "replaying after" in ln]
    assert len(replays) == 2 and all("stage_fault" in ln or "faulty output" in ln
                                     for ln in replays), replays  # fmt: skip


def test_a_stopped_stage_is_found_stalled_and_the_stream_resumes_within_seconds(
    cluster: Cluster,
) -> None:
    a = cluster.start("a")
    b = cluster.start("b", peers=[a])
    wait_for(lambda: all(len(n.cluster()["nodes"]) == 2 for n in (a, b)), 10)
    inst = faultlab.place(a, [a, b])
    (pid,) = faultlab.runner_pids(inst["id"], stage=1)
    events: list[tuple[float, str]] = []
    t = threading.Thread(target=faultlab.stream, args=(a, events, N_TOKENS), daemon=True)
    t.start()
    wait_for(lambda: len(events) >= 15, 30, interval=0.01)
    # Alive but stopped: no exit, no closed socket, no error; only silence.
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    t.join(60)
    assert not t.is_alive() and events[-1][1] == "data: [DONE]", events[-3:]
    assert not any('"error"' in line for _, line in events), [e for e in events if "error" in e[1]]
    numbers = [int(x) for x in re.findall(r"\d+", faultlab.text_of(events))]
    assert numbers == list(range(11, 11 + len(numbers))) and len(numbers) >= 20, numbers
    resumed = next(at for at, _ in events if at > stopped) - stopped
    print(f"\nSIGSTOP -> stream resumed: {resumed:.1f} s")
    assert resumed < 2 * STALL_BOUND_S, resumed
    # b found its runner stalled, ended it (a stopped process heeds SIGKILL) and
    # started it again: counted, said in its log, serving again.
    assert metric_total(b, "meshd_stage_stalls_total") == 1
    assert "stalled: no sign of life" in b.log()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    wait_serving(a, inst["id"], 30)

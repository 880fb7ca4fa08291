"""One node serving the default model, shared by every fuzz test; the figures at the end.

``pytest tests/fuzz`` prints a "fuzz figures" section after the run (no ``-s`` needed):
frames sent per socket, crashes, API cases and server errors. The examples are the same
on every run; ``MESHD_FUZZ_SCALE=10`` runs ten times as many and ``MESHD_FUZZ_RANDOM=1``
draws fresh ones (to hunt for bugs; see harness.fuzz_settings).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import zmq

from meshd.models.resolve import DEFAULT_MODEL
from meshd.transport import wire
from tests.cluster import Cluster, wait_for

from .frames import Target
from .harness import (
    FAKE_ID,
    FIGURES,
    Env,
    close_clients,
    completion,
    pose_as_peer,
    stable_state,
)


@pytest.fixture(scope="package")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """Node ``a`` with the default model placed on it, and the fake peer beside it."""
    ctx = zmq.Context()
    with Cluster(tmp_path_factory.mktemp("fuzz")) as cluster:
        try:
            # The fake peer never sends heartbeats: long runs must not see it forgotten.
            # --open: the fuzzers pose as a peer and write frames by hand, which a
            # secured cluster refuses at the handshake, before any decoder runs
            # (tests/node/test_intruders.py covers that side).
            a = cluster.start("a", extra_args=["--forget-after", "86400", "--open"])
            r = httpx.post(a.api + "/v1/instances",
                           json={"model": DEFAULT_MODEL, "nodes": ["a"]}, timeout=60)  # fmt: skip
            assert r.status_code == 201, r.text
            iid = r.json()["id"]
            wait_for(
                lambda: all(s["state"] == "ready"
                            for s in a.get(f"/v1/instances/{iid}")["stages"]),
                60, interval=0.05,
            )  # fmt: skip
            reference = completion(a)
            topic, pub, fake_mesh = pose_as_peer(cluster, a, ctx)
            sink = ctx.socket(zmq.ROUTER)
            sink.setsockopt(zmq.LINGER, 0)
            sink_port = sink.bind_to_random_port("tcp://127.0.0.1")
            cl = a.cluster()
            inst = next(i for i in cl["instances"] if i["id"] == iid)
            card = next(m["card"] for m in cl["nodes"] if m["id"] == a.node_id)
            target = Target(
                node_id=a.node_id, topic=topic, known_ids=[a.node_id, FAKE_ID], instance=iid,
                generation=inst.get("generation", 1), hidden=inst["facts"]["hidden_size"],
                sink=wire.Addr(node="sink", addresses=["127.0.0.1"], port=sink_port),
                started_ms=card["started_ms"],
            )  # fmt: skip
            # Let the fake peer's arrival settle (liveness, horizon) before the baseline.
            time.sleep(0.3)
            yield Env(
                cluster=cluster, node=a, ctx=ctx, instance=iid, reference=reference,
                baseline=stable_state(a), target=target, pub=pub, fake_mesh=fake_mesh,
                sink=sink,
            )  # fmt: skip
        finally:
            close_clients()
            ctx.destroy(linger=0)


def pytest_terminal_summary(terminalreporter) -> None:
    if not (FIGURES.frames or FIGURES.api_cases):
        return
    terminalreporter.write_sep("-", "fuzz figures")
    for line in FIGURES.lines():
        terminalreporter.write_line(line)

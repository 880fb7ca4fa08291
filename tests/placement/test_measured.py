"""Placement from measurements: each node's decode speed (bytes of weights a step reads
per second) and its round trips to peers decide how the layers split, and whether a
model that fits on one node is split at all; the prediction is shown next to the plan.

The figures here are written by the test; tests/engines/test_calibrate.py and
tests/node/test_measure.py measure real ones.
"""

from __future__ import annotations

import pytest

from meshd.crdt.views import InstanceSpec, Stage
from meshd.domain.facts import ModelFacts
from meshd.domain.nodes import NodeResources
from meshd.placement import place, predicted_tokens_s
from meshd.placement.place import HOP_MS, SPLIT_GAIN, UNKNOWN_RTT_MS

MiB = 1 << 20
GiB = 1 << 30
# 32 layers of 100 MiB, a 200 MiB head: 3.4 GB read per token.
M = ModelFacts(
    name="m",
    sha256="",
    n_layers=32,
    hidden_size=1,
    n_ctx_train=0,
    layer_bytes=[100 * MiB] * 32,
    head_bytes=200 * MiB,
    engines=["llama_cpp"],
)
READ = 32 * 100 * MiB + 200 * MiB
SPEC = InstanceSpec(model="m")


def node(nid: str, mem: int, bps: float = 0.0, rtt: dict[str, float] | None = None):
    return NodeResources(nid, nid, ["llama_cpp-cpu"], mem, decode_bps=bps, rtt_ms=rtt or {})


def by_id(*rs: NodeResources) -> dict[str, NodeResources]:
    return {r.id: r for r in rs}


def test_the_prediction_is_the_bytes_each_stage_reads_at_its_speed_plus_the_ring() -> None:
    a, b = node("a", 64 * GiB, 10e9, {"b": 2.0}), node("b", 64 * GiB, 20e9)
    one = [Stage(node="a", start=0, end=32, engine="llama_cpp")]
    assert predicted_tokens_s(M, one, [a, b]) == pytest.approx(1000 / (1000 * READ / 10e9), 1e-3)
    two = [Stage(node="a", start=0, end=16, engine="llama_cpp"),
           Stage(node="b", start=16, end=32, engine="llama_cpp")]  # fmt: skip
    ms = 1000 * 16 * 100 * MiB / 10e9 + 1000 * (16 * 100 * MiB + 200 * MiB) / 20e9
    ms += 2 * (2.0 / 2 + HOP_MS)  # a -> b and back, over the link a measured
    assert predicted_tokens_s(M, two, [a, b]) == pytest.approx(1000 / ms, 1e-3)
    # No link figure on either side: a default round trip.
    a2 = node("a", 64 * GiB, 10e9)
    ms2 = ms - 2 * (2.0 / 2) + 2 * (UNKNOWN_RTT_MS / 2)
    assert predicted_tokens_s(M, two, [a2, b]) == pytest.approx(1000 / ms2, 1e-3)
    # A node that has not measured: no prediction.
    assert predicted_tokens_s(M, two, [a, node("b", 64 * GiB)]) == 0.0


def test_a_model_that_fits_one_node_stays_there_unless_a_measured_split_is_faster() -> None:
    # Equal speeds: a split only adds hops.
    same = by_id(node("a", 64 * GiB, 10e9), node("b", 32 * GiB, 10e9))
    assert [s.node for s in place(SPEC, M, same)] == ["a"]
    # Unmeasured: the fewest nodes, as always.
    unknown = by_id(node("a", 64 * GiB), node("b", 32 * GiB, 40e9))
    assert [s.node for s in place(SPEC, M, unknown)] == ["a"]
    # b is 4x faster and holds most of it: a split is ~2.5x the speed of a alone.
    fast = by_id(node("a", 64 * GiB, 10e9), node("b", 32 * GiB, 40e9))
    split = place(SPEC, M, fast)
    assert [s.node for s in split] == ["a", "b"]
    assert split[1].end - split[1].start > 3 * (split[0].end - split[0].start)  # by speed
    alone = [Stage(node="a", start=0, end=32, engine="llama_cpp")]
    gain = predicted_tokens_s(M, split, fast.values()) / predicted_tokens_s(M, alone, fast.values())
    assert gain > SPLIT_GAIN
    # b 1.5x faster: a split gains ~1.25x on a LAN, but over a slow link (64 ms round
    # trips) less than SPLIT_GAIN, and one node stays.
    near = by_id(node("a", 64 * GiB, 10e9, {"b": 0.5}), node("b", 32 * GiB, 15e9))
    assert [s.node for s in place(SPEC, M, near)] == ["a", "b"]
    far = by_id(node("a", 64 * GiB, 10e9, {"b": 64.0}), node("b", 32 * GiB, 15e9))
    assert [s.node for s in place(SPEC, M, far)] == ["a"]


def test_the_split_follows_speed_within_memory() -> None:
    # b is 3x faster but holds only 8 layers beside the floor and KV: it takes 8.
    spec = InstanceSpec(model="m", min_nodes=2)
    roomy = by_id(node("a", 64 * GiB, 10e9), node("b", 64 * GiB, 30e9))
    stages = place(spec, M, roomy)
    assert [s.end - s.start for s in stages] == [8, 24]
    small = by_id(node("a", 64 * GiB, 10e9), node("b", 1536 * MiB, 30e9))
    stages = place(spec, M, small)
    assert stages[1].end - stages[1].start < 24 and stages[1].end == 32


#: A mixture of experts as big as M: 32 layers of 100 MiB, of which a token reads 10.
MOE = ModelFacts(
    name="moe",
    sha256="",
    n_layers=32,
    hidden_size=1,
    n_ctx_train=0,
    layer_bytes=[100 * MiB] * 32,
    layer_active_bytes=[10 * MiB] * 32,
    head_bytes=200 * MiB,
    engines=["llama_cpp"],
)


def test_a_mixture_of_experts_is_timed_by_the_bytes_a_token_reads() -> None:
    a = node("a", 64 * GiB, 10e9)
    one = [Stage(node="a", start=0, end=32, engine="llama_cpp")]
    active = 32 * 10 * MiB + 200 * MiB
    assert (MOE.total_bytes, MOE.active_bytes) == (READ, active)
    assert predicted_tokens_s(MOE, one, [a]) == pytest.approx(1000 / (1000 * active / 10e9), 1e-3)
    # Memory is the whole model's: the plan is the dense one's.
    nodes = by_id(node("a", 3 * GiB, 10e9), node("b", 3 * GiB, 10e9))
    assert place(SPEC, MOE, nodes) == place(SPEC, M, nodes)
    # Facts without active bytes (a dense model, or facts from before they were read)
    # read every layer whole.
    assert M.active_layer_bytes() == M.layer_bytes and M.active_bytes == M.total_bytes

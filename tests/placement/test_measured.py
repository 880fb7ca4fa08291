"""Placement from measurements: each node's decode speed (bytes of weights a step reads
per second), its round trips to peers and its links' bandwidth decide how the layers
split, and whether a model that fits on one node is split at all; the prediction is
shown next to the plan.

The figures here are written by the test; tests/engines/test_calibrate.py and
tests/node/test_measure.py measure real ones.
"""

from __future__ import annotations

import msgspec
import pytest

from meshd.crdt.views import Health, InstanceSpec, Stage
from meshd.domain.facts import ModelFacts
from meshd.domain.nodes import NodeResources
from meshd.placement import node_resources, place, predicted_tokens_s, predicted_transfer_s
from meshd.placement.place import SPLIT_GAIN
from meshd.placement.predict import ANSWER_TOKENS, HOP_MS, UNKNOWN_RTT_MS
from meshd.placement.resources import quantize_bw

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


def node(
    nid: str,
    mem: int,
    bps: float = 0.0,
    rtt: dict[str, float] | None = None,
    bw: dict[str, float] | None = None,
):
    return NodeResources(
        nid, nid, ["llama_cpp-cpu"], mem, decode_bps=bps, rtt_ms=rtt or {}, bw_mbps=bw or {}
    )


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


# ------------------------------------------------------------------- bandwidth

#: M with a Llama-8B-sized hidden state: a 4096-token prompt (the context placement
#: prices when the spec sets none) is 32 MiB of f16 rows a hop.
WIDE = msgspec.structs.replace(M, hidden_size=4096)
PROMPT = 4096 * 4096 * 2


def test_a_split_over_a_slow_link_is_refused_when_one_node_answers_sooner() -> None:
    # b is 4x faster: a split decodes ~2.5x as fast as a alone (see above), and on
    # a link nobody measured, or a fast one, it is taken.
    def nodes(mbps: float | None) -> dict[str, NodeResources]:
        bw = {"b": mbps} if mbps else {}
        return by_id(node("a", 64 * GiB, 10e9, {"b": 0.5}, bw), node("b", 32 * GiB, 40e9))

    assert [s.node for s in place(SPEC, WIDE, nodes(None))] == ["a", "b"]
    assert [s.node for s in place(SPEC, WIDE, nodes(1000.0))] == ["a", "b"]
    # Over 1 Mbit/s the prompt's 32 MiB take ~270 s, far more than the ~50 s the
    # split saves on the answer: a alone.
    assert [s.node for s in place(SPEC, WIDE, nodes(1.0))] == ["a"]
    # The rows are the instance's context long, at its hops' dtype: over 8 Mbit/s a
    # 4096-token context's f16 rows (~34 s) leave the split sooner, a 16384-token
    # one's or f32 rows do not.
    at = nodes(8.0)
    assert [s.node for s in place(SPEC, WIDE, at)] == ["a", "b"]
    assert [s.node for s in place(InstanceSpec(model="m", context=16384), WIDE, at)] == ["a"]
    assert [s.node for s in place(InstanceSpec(model="m", activations="f32"), WIDE, at)] == ["a"]
    short = InstanceSpec(model="m", context=2048, activations="f32")
    assert [s.node for s in place(short, WIDE, at)] == ["a", "b"]


def test_a_model_that_fits_no_single_node_is_split_over_a_slow_link_and_its_cost_shown() -> None:
    slow = by_id(node("a", 3 * GiB, 10e9, bw={"b": 8.0}), node("b", 3 * GiB, 10e9))
    plan = place(SPEC, WIDE, slow)
    assert [s.node for s in plan] == ["a", "b"]
    # Reported, not refused: the prompt's rows over the one forward hop, at 8 Mbit/s.
    assert predicted_transfer_s(WIDE, plan, slow.values()) == pytest.approx(PROMPT * 8 / 8e6, 1e-3)
    f32 = predicted_transfer_s(WIDE, plan, slow.values(), "f32")
    assert f32 == pytest.approx(2 * PROMPT * 8 / 8e6, 1e-3)
    assert predicted_transfer_s(WIDE, plan, slow.values(), context=1024) == pytest.approx(
        1024 * 4096 * 2 * 8 / 8e6, 1e-3
    )
    # Unknown links and one stage cost nothing to transfer.
    unknown = by_id(node("a", 3 * GiB, 10e9), node("b", 3 * GiB, 10e9))
    assert predicted_transfer_s(WIDE, plan, unknown.values()) == 0.0
    assert predicted_transfer_s(WIDE, plan[:1], slow.values()) == 0.0


def test_a_link_is_as_fast_as_the_slower_figure_either_end_measured() -> None:
    two = [Stage(node="a", start=0, end=16, engine="llama_cpp"),
           Stage(node="b", start=16, end=32, engine="llama_cpp")]  # fmt: skip
    one_side = [node("a", GiB), node("b", GiB, bw={"a": 100.0})]
    both = [node("a", GiB, bw={"b": 400.0}), node("b", GiB, bw={"a": 100.0})]
    want = PROMPT * 8 / 100e6
    assert predicted_transfer_s(WIDE, two, one_side) == pytest.approx(want, 1e-3)
    assert predicted_transfer_s(WIDE, two, both) == pytest.approx(want, 1e-3)
    # Only the forward hop carries the rows: the token back to stage 0 is one row.
    three = [*two[:1], Stage(node="b", start=16, end=24, engine="llama_cpp"),
             Stage(node="c", start=24, end=32, engine="llama_cpp")]  # fmt: skip
    ring = [node("a", GiB, bw={"b": 100.0, "c": 1.0}), node("b", GiB, bw={"c": 100.0}),
            node("c", GiB)]  # fmt: skip
    assert predicted_transfer_s(WIDE, three, ring) == pytest.approx(2 * want, 1e-3)
    assert ANSWER_TOKENS > 0


def test_bandwidths_come_from_the_heartbeat_rounded_down_and_missing_is_unknown() -> None:
    from meshd.crdt.views import NodeCard

    cards = {
        n: NodeCard(id=n, name=n, incarnation="i", cluster="c", version="0", os="linux",
                    arch="x86_64", cpu_count=4, mem_total=16 * GiB, mem_available=8 * GiB,
                    backends=["llama_cpp-cpu"], mesh_port=1, pub_port=2, api_port=3)
        for n in ("a", "b")
    }  # fmt: skip
    healths = {"a": Health(seq=1, bw_mbps={"b": 900.0, "z": 50.0, "c": float("nan")})}
    # A heartbeat of a node from before bandwidths were measured has none: unknown.
    old = msgspec.msgpack.encode({"seq": 1, "rtt_ms": {"a": 1.0}})
    healths["b"] = msgspec.msgpack.decode(old, type=Health)
    res = node_resources(cards, healths, ["a", "b"])
    assert res["a"].bw_mbps == {"b": 512.0} and res["b"].bw_mbps == {}
    assert [quantize_bw(x) for x in (0.0, 0.3, 1.0, 99.0, 100.0, 1e5)] == [
        0.0, 1.0, 1.0, 64.0, 64.0, 65536.0
    ]  # fmt: skip

"""What a model allows placement: an engine only where it builds the model's
architecture from its format, and a cut into stages only where the split is proven.

Macs rank ``mlx-metal`` first, so before this rule a Qwen, Gemma or Phi GGUF went to
MLX there, whose GGUF path builds llama models only; and every architecture but five
was cut, proven or not (a GPT-2 cut in two answers other text than whole).
"""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from meshd.crdt.views import Instance, InstanceSpec
from meshd.crdt.views import Stage as S
from meshd.domain.builds import buildable_engines
from meshd.domain.facts import ModelFacts
from meshd.domain.nodes import NodeResources
from meshd.placement import SPLIT_PROVEN, PlacementError, model_engines, place, split_refusal
from meshd.placement.support import CUT_PERIODS, cut_period

GiB = 1 << 30
#: A Mac: MLX on Metal ranked first, llama.cpp on Metal too.
MAC = ["mlx-metal", "llama_cpp-metal"]

#: The architectures of the engine matrices (tests/engines/test_architectures.py for
#: GGUFs, test_mlx_architectures.py for folders): each test there ties its matrix to
#: these lists.
GGUF_ARCHS = sorted(SPLIT_PROVEN["gguf"])
FOLDER_ARCHS = sorted(SPLIT_PROVEN["mlx"])
#: Architectures llama.cpp runs whose split no test proves (gpt2, bloom: measured or
#: read in llama.cpp's graph to differ or abort cut).
UNPROVEN = ["bloom", "command-r", "falcon", "gpt2", "mamba", "qwen2vl", "rwkv6",
            "starcoder2"]  # fmt: skip


def facts(
    arch: str, fmt: str = "gguf", engines: tuple[str, ...] = ("llama_cpp", "mlx"), n: int = 4
):
    """An ``n``-layer model of ``arch``, 1 GiB a layer. Listing MLX for every architecture
    is what facts read by an older meshd said (and peers running one still say)."""
    return ModelFacts(
        name=f"{arch}-model", sha256="0" * 64, format=fmt, architecture=arch, n_layers=n,
        hidden_size=64, n_ctx_train=512, layer_bytes=[GiB] * n, engines=list(engines),
    )  # fmt: skip


def nodes(*backends: list[str], mem: int = 64 * GiB) -> dict[str, NodeResources]:
    ids = [f"{i:08x}" for i in range(len(backends))]
    return {
        nid: NodeResources(id=nid, name=f"mac{i}", backends=b, mem_available=mem)
        for i, (nid, b) in enumerate(zip(ids, backends, strict=True))
    }


# ------------------------------------------------------------------------- engines


@pytest.mark.parametrize("arch", [a for a in GGUF_ARCHS if a != "llama"])
@pytest.mark.parametrize("listed", [("llama_cpp", "mlx"), ("llama_cpp",)], ids=["old", "new"])
def test_a_non_llama_gguf_runs_on_llama_cpp_on_a_mac(arch: str, listed: tuple[str, ...]) -> None:
    f = facts(arch, engines=listed, n=4 * cut_period(facts(arch)))
    assert model_engines(f)[0] == ("llama_cpp",)
    for spec in (InstanceSpec(model="m"), InstanceSpec(model="m", min_nodes=2)):
        stages = place(spec, f, nodes(MAC, MAC))
        assert {s.engine for s in stages} == {"llama_cpp"}


def test_a_quantized_kv_cache_is_kept_by_llama_cpp_and_refused_on_mlx_by_name() -> None:
    # MLX stages keep an f16 cache: a q8_0 instance on a Mac runs on llama.cpp, and
    # pinned to MLX it is refused with why, never given a cache type it ignores.
    spec = InstanceSpec(model="m", kv_cache="q8_0")
    (stage,) = place(spec, facts("llama"), nodes(MAC))
    assert stage.engine == "llama_cpp"
    assert ("mlx", "MLX stages keep an f16 KV cache, not q8_0 (llama_cpp keeps q8_0)") in (
        model_engines(facts("llama"), "q8_0")[1]
    )
    with pytest.raises(PlacementError, match="not on 'mlx': MLX stages keep an f16 KV cache"):
        place(replace(spec, engines=["mlx"]), facts("llama"), nodes(MAC))
    with pytest.raises(PlacementError, match="mlx cannot run it: MLX stages keep an f16"):
        place(spec, facts("llama"), nodes(["mlx-metal"]))


def test_a_llama_gguf_may_run_on_mlx_on_a_mac() -> None:
    (stage,) = place(InstanceSpec(model="m"), facts("llama"), nodes(MAC))
    assert stage.engine == "mlx"
    # A llama GGUF MLX cannot read (its facts leave MLX out: a Q1_0 tensor, experts).
    (stage,) = place(InstanceSpec(model="m"), facts("llama", engines=("llama_cpp",)), nodes(MAC))
    assert stage.engine == "llama_cpp"


@pytest.mark.parametrize("arch", FOLDER_ARCHS)
def test_a_folder_mlx_builds_runs_on_mlx(arch: str) -> None:
    stages = place(InstanceSpec(model="m", min_nodes=2), facts(arch, "mlx", ("mlx",)),
                   nodes(MAC, ["llama_cpp-cpu", "mlx-cpu"]))  # fmt: skip
    assert {s.engine for s in stages} == {"mlx"}


@pytest.mark.parametrize("arch", [a for a in GGUF_ARCHS if a != "llama"])
def test_a_mac_with_only_mlx_refuses_a_non_llama_gguf_and_says_why(arch: str) -> None:
    with pytest.raises(PlacementError) as err:
        place(InstanceSpec(model="m"), facts(arch), nodes(["mlx-metal"]))
    e = err.value
    assert e.reason == "no_backend" and e.shortfalls == {}
    assert "needs a node with a backend for llama_cpp" in e.message
    assert "mlx cannot run it" in e.message and f"not {arch!r}" in e.message
    assert "architecture llama only" in e.message
    # Pinned to the node: the same reason.
    with pytest.raises(PlacementError) as err:
        place(InstanceSpec(model="m", nodes=["mac0"]), facts(arch), nodes(["mlx-metal"]))
    assert err.value.reason == "no_backend" and f"not {arch!r}" in err.value.message


@pytest.mark.parametrize(
    "spec",
    [
        InstanceSpec(model="m", engines=["mlx"]),
        InstanceSpec(model="m", nodes=["mac0"], engines=["mlx"]),
    ],
    ids=["engine", "node-and-engine"],
)
def test_pinning_a_qwen2_gguf_to_mlx_is_refused_with_why(spec: InstanceSpec) -> None:
    with pytest.raises(PlacementError) as err:
        place(spec, facts("qwen2"), nodes(MAC))
    assert err.value.reason == "bad_spec"
    assert "runs on llama_cpp, not on 'mlx'" in err.value.message
    assert "not 'qwen2'" in err.value.message


def test_a_plan_an_older_node_put_on_mlx_is_repaired_onto_llama_cpp() -> None:
    f, spec = facts("qwen2"), InstanceSpec(model="m")
    mac = nodes(MAC)
    old = Instance(id="i", spec=spec, facts=f, generation=1,
                   stages=[S(node="00000000", start=0, end=4, engine="mlx")])  # fmt: skip
    # Its MLX stage cannot build the model: it does not survive; the same Mac takes
    # the model on llama.cpp (so the plan check, place() again, refuses the old plan).
    assert place(spec, f, mac, old) == [S(node="00000000", start=0, end=4, engine="llama_cpp")]


def test_a_model_llama_cpp_loads_but_cannot_generate_with_is_refused_with_why() -> None:
    with pytest.raises(PlacementError) as err:
        place(
            InstanceSpec(model="m"), facts("t5", engines=("llama_cpp",)), nodes(["llama_cpp-cpu"])
        )
    e = err.value
    assert e.reason == "no_backend" and "encoder-decoder" in e.message


def test_a_model_no_engine_builds_is_refused_naming_each_engine() -> None:
    with pytest.raises(PlacementError) as err:
        place(InstanceSpec(model="m"), facts("nonesuch"), nodes(MAC))
    e = err.value
    assert e.reason == "no_backend"
    assert "llama_cpp cannot: llama.cpp knows no architecture 'nonesuch'" in e.message
    assert "mlx cannot: MLX reads GGUFs of architecture llama only" in e.message
    # A folder of a type MLX does not build (its facts list no engine).
    with pytest.raises(PlacementError) as err:
        place(InstanceSpec(model="m"), facts("olmo2", "mlx", ()), nodes(MAC))
    assert "MLX builds model folders of type" in err.value.message
    assert "llama.cpp reads GGUF files, not model folders" in err.value.message


def test_the_rule_offers_what_each_engine_builds() -> None:
    assert buildable_engines("gguf", "llama") == ["llama_cpp", "mlx"]
    for arch in ("qwen2", "qwen3", "gemma3", "phi3", "gpt2"):
        assert buildable_engines("gguf", arch) == ["llama_cpp"]
    assert buildable_engines("gguf", "clip") == []  # a vision projector, not a model
    # llama.cpp loads these, but a stage cannot make text with them (one decode step
    # after another): t5's decoder needs llama_encode, the others are no text decoders.
    for arch in ("t5", "wavtokenizer-dec", "dream", "llada", "llada-moe", "rnd1"):
        assert buildable_engines("gguf", arch) == []
    assert buildable_engines("gguf", "t5encoder") == ["llama_cpp"]  # it embeds
    for arch in FOLDER_ARCHS:
        assert buildable_engines("mlx", arch) == ["mlx"]
    assert buildable_engines("mlx", "gemma3") == ["mlx"]  # an image-text folder
    assert buildable_engines("mlx", "olmo2") == []


# -------------------------------------------------------------------------- splits


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_an_architecture_proven_to_split_is_cut_when_asked(arch: str) -> None:
    assert split_refusal(facts(arch)) is None
    n = 4 * cut_period(facts(arch))  # smollm3, llama4: cut every 4 layers
    stages = place(InstanceSpec(model="m", min_nodes=2), facts(arch, "gguf", ("llama_cpp",), n),
                   nodes(["llama_cpp-cpu"], ["llama_cpp-cpu"]))  # fmt: skip
    assert len(stages) == 2 and all(s.start % cut_period(facts(arch)) == 0 for s in stages)


@pytest.mark.parametrize("arch", sorted(CUT_PERIODS))
def test_a_model_too_short_for_its_cut_period_runs_whole_and_says_why(arch: str) -> None:
    f, cpu = facts(arch, engines=("llama_cpp",)), ["llama_cpp-cpu"]
    with pytest.raises(PlacementError, match=rf"\({arch}\) is cut only every 4 layers \(llama"
                       r".*4 layers make at most 1 stage"):  # fmt: skip
        place(InstanceSpec(model="m", min_nodes=2), f, nodes(cpu, cpu))
    # Room for half on each of two nodes: not cut, and the memory error says why.
    with pytest.raises(PlacementError) as err:
        place(InstanceSpec(model="m"), f, nodes(cpu, cpu, mem=3 * GiB))
    assert err.value.reason == "insufficient_memory" and "cut only every 4" in err.value.message


@pytest.mark.parametrize("arch", UNPROVEN)
def test_an_architecture_not_proven_to_split_runs_whole_and_says_why(arch: str) -> None:
    f = facts(arch, engines=("llama_cpp",))
    why = split_refusal(f)
    assert why
    cpu = ["llama_cpp-cpu"]
    # Room for the whole model on one node: one stage, wherever min_nodes is not asked.
    (stage,) = place(InstanceSpec(model="m"), f, nodes(cpu, cpu))
    assert (stage.start, stage.end) == (0, 4)
    # Asked for two: refused, with why.
    with pytest.raises(PlacementError) as err:
        place(InstanceSpec(model="m", min_nodes=2), f, nodes(cpu, cpu))
    assert err.value.reason == "bad_spec"
    assert f"({arch}) runs whole on one node: {why}" in err.value.message
    # Room for half on each of two nodes: not cut, and the memory error says why.
    with pytest.raises(PlacementError) as err:
        place(InstanceSpec(model="m"), f, nodes(cpu, cpu, mem=3 * GiB))
    assert err.value.reason == "insufficient_memory" and why in err.value.message


def test_gpt2s_reason_is_what_its_graph_does_to_a_later_stage() -> None:
    assert "position embeddings" in (split_refusal(facts("gpt2")) or "")
    assert "proven for deepseek2, gemma" in (split_refusal(facts("command-r")) or "")
    # Folders: the MLX matrix's list; a GGUF of a folder-only name is not proven.
    assert split_refusal(facts("mistral", "mlx", ("mlx",))) is None
    assert split_refusal(facts("mistral")) is not None
    encoder = replace(facts("qwen3"), embedding_only=True)
    assert "encoder" in (split_refusal(encoder) or "")


def test_a_hybrid_is_cut_only_where_each_stage_holds_both_its_kinds_of_layer() -> None:
    # Recurrent, attention, recurrent, recurrent, attention, recurrent: llama.cpp aborts
    # on a stage of one kind only, so two stages can only meet after layer 1 or 2.
    f = replace(facts("lfm2", engines=("llama_cpp",)), n_layers=6, layer_bytes=[GiB] * 6,
                layer_state="rarrar")  # fmt: skip
    cpu = ["llama_cpp-cpu"]
    two = place(InstanceSpec(model="m", min_nodes=2), f, nodes(cpu, cpu))
    assert [(s.start, s.end) for s in two] in ([(0, 2), (2, 6)], [(0, 3), (3, 6)])
    # Three stages cannot each hold both: refused rather than cut where llama.cpp aborts.
    with pytest.raises(PlacementError):
        place(InstanceSpec(model="m", min_nodes=3), f, nodes(cpu, cpu, cpu))
    # A repair keeps the rule: the dead stage's layers go where both kinds stay together.
    prev = Instance(id="i", spec=InstanceSpec(model="m"), facts=f, generation=1,
                    stages=[S(node=n, start=a, end=b, engine="llama_cpp")
                            for n, (a, b) in zip(("00000000", "00000001"), [(0, 3), (3, 6)],
                                                 strict=True)])  # fmt: skip
    alive = {k: v for k, v in nodes(cpu, cpu, cpu).items() if k != "00000001"}
    for s in place(InstanceSpec(model="m"), f, alive, prev):
        assert set(f.layer_state[s.start : s.end]) == {"a", "r"}

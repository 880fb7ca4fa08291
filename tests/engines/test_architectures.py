"""Other architectures through llama.cpp stages: a model cut in two gives what the
whole model gives, for shapes other than the default model's (attention biases, an
untied output head). This matrix is the proof placement's split allowlist
(``meshd.placement.support.SPLIT_PROVEN["gguf"]``) stands on: a test ties the two.
Every other architecture runs whole (GPT-2: cut, it answers other text), and MLX is
offered for a GGUF only where its GGUF path builds the architecture (llama).

The models are small GGUFs written here (random weights, the default model's
tokenizer): no download, and every tensor shape is the architecture's own.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from meshd.crdt.views import InstanceSpec
from meshd.domain.facts import ModelFacts
from meshd.domain.recurrent import RECURRENT_ARCHITECTURES
from meshd.engines.llama_stage import LlamaStage
from meshd.models.errors import UnsupportedModelError
from meshd.models.facts import read_facts
from meshd.models.hashing import file_sha256
from meshd.models.mlx_layout import check_gguf_for_mlx
from meshd.models.slicing import slice_gguf
from meshd.placement import SPLIT_PROVEN, PlacementError, place
from meshd.placement.resources import NodeResources
from tests.engines.chains import greedy as greedy_chain
from tests.synthetic import N_LAYERS, write_gpt2, write_model
from tests.synthetic_archs import ARCHS, write_arch

pytestmark = pytest.mark.timeout(300)


def greedy(chain: list[LlamaStage], prompt: list[int], n: int = 8):
    """Greedy tokens and their logits through a chain of stages."""
    return greedy_chain(chain, prompt, n)


PROMPT = "Once upon a time there was a little girl who lived in a village near the forest"

Run = tuple[list[int], list[np.ndarray]]


def _stage(path: Path, first: bool, last: bool) -> LlamaStage:
    return LlamaStage(path, first=first, last=last, n_ctx=256, n_seq_max=1, exact=True)


def run_whole(path: Path) -> tuple[list[int], Run]:
    """The prompt's tokens, and greedy tokens and logits of the whole model."""
    with _stage(path, True, True) as whole:
        prompt = whole.tokenize(PROMPT, add_special=False, parse_special=False)
        assert len(prompt) > 8  # longer than the sliding windows below
        return prompt, greedy([whole], prompt)


U = np.uint32
#: Architecture -> (write_model options, metadata). Windows of 4 tokens make the
#: sliding-window layers matter for the prompt above.
MATRIX = {
    "qwen2-attention-biases": ("qwen2", {"bias": True}, {}),
    "llama-untied-head": ("llama", {"tied": False}, {}),
    "qwen3-qk-norms": ("qwen3", {}, {}),
    "gemma-input-scaled": ("gemma", {}, {}),
    "gemma2-scaled-and-windowed": ("gemma2", {}, {"gemma2.attention.sliding_window": U(4)}),
    "gemma3-windowed": ("gemma3", {}, {"gemma3.attention.sliding_window": U(4),
                                       "gemma3.attention.sliding_window_pattern": U(2)}),
    "granite-scales": ("granite", {}, {"granite.embedding_scale": 12.0,
                                       "granite.residual_scale": 0.22,
                                       "granite.logit_scale": 8.0,
                                       "granite.attention.scale": 0.25}),
    "minicpm-default-scales": ("minicpm", {}, {}),
    "phi3-fused-gate-up": ("phi3", {}, {}),
    "qwen3moe-experts": ("qwen3moe", {}, {}),
}  # fmt: skip
#: The architectures households run (tests/synthetic_archs.py), each written as
#: llama.cpp's loader wants it: gpt-oss (attention sinks, a window on every 2nd layer,
#: biased experts), olmo2 (norms after attention and FFN), mistral3, deepseek2 (latent
#: attention, a dense first layer, shared experts), and two hybrids whose recurrent
#: layers keep their state on the stage that owns them (lfm2's short convolutions,
#: granitehybrid's Mamba-2), cut so that each stage holds both kinds of layer;
#: smollm3 and llama4 (rope skipped on every 4th layer, counted from a slice's first:
#: cut at multiples of 4 only, see test_a_model_cut_every_4_layers_...), glm4moe (a
#: later stage's slice states rope sections, or llama.cpp aborts on its rows: "This
#: GGUF does not support multimodal").
CASES = {**{case: (arch, N_LAYERS) for case, (arch, _, _) in MATRIX.items()},
         **{case: (arch, n) for case, (arch, n, _, _) in ARCHS.items()}}  # fmt: skip
#: Where a model of n layers is cut into 2 and into 3 stages.
CUTS = {4: {2: (1,), 3: (1, 3)}, 6: {2: (2,), 3: (2, 4)}, 12: {2: (4,), 3: (4, 8)}}


@pytest.fixture(scope="module")
def models(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each case's model, written once for the module."""
    folder = tmp_path_factory.mktemp("archs")

    @functools.cache
    def get(case: str) -> Path:
        if case in ARCHS:
            return write_arch(folder / f"{case}.gguf", model_path, case)
        arch, opts, meta = MATRIX[case]
        return write_model(folder / f"{case}.gguf", model_path, arch, metadata=meta, **opts)

    return get


@pytest.fixture(scope="module")
def slice_stages(models: Callable[[str], Path]) -> Iterator[Callable[[str, int, int], LlamaStage]]:
    """Stages of each case's slices, loaded once for the module: both cuts start with
    layer [0, 1) (greedy frees its sequence after each run)."""
    opened: dict[tuple[str, int, int], LlamaStage] = {}

    def get(case: str, a: int, b: int) -> LlamaStage:
        if (case, a, b) not in opened:
            path = models(case)
            part = slice_gguf(path, a, b, path.parent / "slices", file_sha256(path))
            opened[case, a, b] = _stage(part, a == 0, b == CASES[case][1])
        return opened[case, a, b]

    yield get
    for stage in opened.values():
        stage.close()


@pytest.fixture(scope="module")
def whole_runs(models: Callable[[str], Path]) -> Callable[[str], tuple[list[int], Run]]:
    """Each case's whole-model run, made once: every cut is held to the same one."""
    return functools.cache(lambda case: run_whole(models(case)))


@pytest.mark.parametrize("n_stages", [2, 3], ids=["2-stages", "3-stages"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_model_cut_in_stages_gives_the_whole_models_logits(
    models: Callable[[str], Path],
    slice_stages: Callable[[str, int, int], LlamaStage],
    whole_runs: Callable[[str], tuple[list[int], Run]],
    case: str,
    n_stages: int,
) -> None:
    arch, n_layers = CASES[case]
    prompt, (one, one_logits) = whole_runs(case)
    ranges = itertools.pairwise([0, *CUTS[n_layers][n_stages], n_layers])
    two, two_logits = greedy([slice_stages(case, a, b) for a, b in ranges], prompt)
    assert two == one
    worst = max(float(np.abs(a - b).max()) for a, b in zip(one_logits, two_logits, strict=True))
    assert worst <= 1e-4, worst
    facts = read_facts(models(case), arch, sha256="0" * 64)
    nodes = {n: NodeResources(id=n, name=n, backends=["llama_cpp-cpu"], mem_available=1 << 40)
             for n in ("a", "b")}  # fmt: skip
    assert len(place(InstanceSpec(model=arch, min_nodes=2), facts, nodes)) == 2


def test_a_gemma2_slice_keeps_its_layers_window_flags(models: Callable[[str], Path]) -> None:
    import gguf

    path = models("gemma2-scaled-and-windowed")  # a window of 4, every 2nd layer global
    part = slice_gguf(path, 1, 3, path.parent / "slices", file_sha256(path))
    flags = gguf.GGUFReader(part).fields["gemma2.attention.sliding_window_pattern"].contents()
    # Layers 1 and 2 of the model: global, then windowed (every 2nd layer is global).
    assert [bool(x) for x in flags] == [False, True]


def test_an_architecture_whose_split_is_not_proven_runs_on_one_node() -> None:
    facts = ModelFacts(
        name="g3n", sha256="0" * 64, architecture="gemma3n", n_layers=4, hidden_size=64,
        n_ctx_train=512, layer_bytes=[1 << 20] * 4, engines=["llama_cpp"],
    )  # fmt: skip
    nodes = {n: NodeResources(id=n, name=n, backends=["llama_cpp-cpu"], mem_available=1 << 40)
             for n in ("a", "b")}  # fmt: skip
    with pytest.raises(PlacementError, match="one node"):
        place(InstanceSpec(model="g3n", min_nodes=2), facts, nodes)
    assert len(place(InstanceSpec(model="g3n"), facts, nodes)) == 1


def test_the_split_allowlist_is_what_this_matrix_proves() -> None:
    # An architecture is cut only with its case here (whole vs 2 and 3 stages), and a
    # case here is for an architecture placement cuts.
    assert SPLIT_PROVEN["gguf"] == {arch for arch, _ in CASES.values()}


#: A Mac: MLX on Metal ranked first, llama.cpp on Metal too.
MAC = {"mac": NodeResources(id="mac", name="mac", backends=["mlx-metal", "llama_cpp-metal"],
                            mem_available=1 << 40)}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_mlx_is_offered_for_a_gguf_only_where_it_builds_the_architecture(
    models: Callable[[str], Path], case: str
) -> None:
    arch, path = CASES[case][0], models(case)
    facts = read_facts(path, arch, sha256="0" * 64)
    if arch == "llama":
        assert facts.engines == ["llama_cpp", "mlx"]
        check_gguf_for_mlx(path)
    else:
        # The facts and the MLX stage's own check agree, for the architecture's reason.
        assert facts.engines == ["llama_cpp"]
        with pytest.raises(UnsupportedModelError, match=f"architecture llama only.*'{arch}'"):
            check_gguf_for_mlx(path)
    (stage,) = place(InstanceSpec(model=arch), facts, MAC)
    assert stage.engine == ("mlx" if arch == "llama" else "llama_cpp")


def test_a_gpt2_runs_whole_and_answers_llama_cpps_own_greedy_text(
    model_path: Path, tmp_path: Path
) -> None:
    """GPT-2 adds learned position embeddings to the token rows at its graph's input,
    and llama.cpp adds them again to the rows a later stage receives: cut in two it
    answers other text, silently. So it is placed whole, and whole it answers what
    llama.cpp answers."""
    import llama_cpp

    path = write_gpt2(tmp_path / "gpt2.gguf", model_path)
    facts = read_facts(path, "gpt2", sha256="0" * 64)
    assert facts.architecture == "gpt2" and facts.engines == ["llama_cpp"]
    nodes = {n: NodeResources(id=n, name=n, backends=["llama_cpp-cpu"], mem_available=1 << 40)
             for n in ("a", "b")}  # fmt: skip
    (stage,) = place(InstanceSpec(model="gpt2"), facts, nodes)
    assert (stage.start, stage.end, stage.engine) == (0, N_LAYERS, "llama_cpp")
    with pytest.raises(PlacementError, match=r"runs whole on one node: .*position embeddings"):
        place(InstanceSpec(model="gpt2", min_nodes=2), facts, nodes)

    # The plan's one stage gives llama.cpp's own greedy text.
    prompt, (tokens, _) = run_whole(path)
    llm = llama_cpp.Llama(
        str(path), n_ctx=256, n_threads=1, n_threads_batch=1, flash_attn=False,
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False,
    )  # fmt: skip
    try:
        want = llm.create_completion(PROMPT, max_tokens=len(tokens), temperature=0.0, top_k=1,
                                     repeat_penalty=1.0)["choices"][0]["text"]  # fmt: skip
        assert llm.tokenize(PROMPT.encode(), add_bos=False) == prompt
        assert llm.detokenize(tokens).decode() == want
    finally:
        llm.close()

    # Cut in two, it answers otherwise: why gpt2 is not in SPLIT_PROVEN. (Should this
    # fail, llama.cpp hands a later stage's rows on untouched: prove gpt2 in MATRIX.)
    parts = [slice_gguf(path, a, b, tmp_path / "slices", file_sha256(path))
             for a, b in ((0, 2), (2, N_LAYERS))]  # fmt: skip
    chain = [_stage(parts[0], True, False), _stage(parts[1], False, True)]
    try:
        cut, _ = greedy(chain, prompt)
    finally:
        for s in chain:
            s.close()
    assert cut != tokens


@pytest.mark.parametrize("case", ["lfm2", "granitehybrid"])
def test_each_stage_of_a_hybrid_holds_both_its_kinds_of_layer(
    models: Callable[[str], Path], slice_stages: Callable[[str, int, int], LlamaStage], case: str
) -> None:
    """A stage of a hybrid's recurrent layers only (or attention only) has a memory
    llama.cpp never gives a buffer, and aborts the process at its first decode: such a
    stage is never placed. Each stage keeps the recurrent state of its own layers."""
    arch, n = CASES[case]
    facts = read_facts(models(case), arch, sha256="0" * 64)
    assert facts.layer_state == "ra" * (n // 2)
    nodes = {x: NodeResources(id=x, name=x, backends=["llama_cpp-cpu"], mem_available=1 << 40)
             for x in "abc"}  # fmt: skip
    for k in (2, 3):
        stages = place(InstanceSpec(model=arch, min_nodes=k), facts, nodes)
        assert len(stages) == k
        assert all(set(facts.layer_state[s.start : s.end]) == {"a", "r"} for s in stages)
    # llama.cpp's own word for its memory is meshd's rule's (meshd.domain.recurrent).
    assert slice_stages(case, 0, 2).recurrent and arch in RECURRENT_ARCHITECTURES
    assert not slice_stages("qwen3-qk-norms", 0, 1).recurrent


def test_a_model_cut_every_4_layers_is_placed_so_and_says_why(
    models: Callable[[str], Path],
    slice_stages: Callable[[str, int, int], LlamaStage],
    whole_runs: Callable[[str], tuple[list[int], Run]],
) -> None:
    """smollm3 and llama4 skip rope on every 4th layer counted from a file's first
    layer: a stage starting elsewhere rotates other layers (smollm3 answers other
    tokens; llama4 aborts the process). Placement starts each stage at a multiple of 4,
    moving the cut it wanted, and says why when asked for more stages than that gives."""
    facts = read_facts(models("smollm3"), "smollm3", sha256="0" * 64)
    nodes = {x: NodeResources(id=x, name=x, backends=["llama_cpp-cpu"], mem_available=1 << 40)
             for x in "abcd"}  # fmt: skip
    # Two equal nodes want the cut at 6 of 12 layers: it moves to 4 (ties go lower).
    stages = place(InstanceSpec(model="smollm3", min_nodes=2), facts, nodes)
    assert [(s.start, s.end) for s in stages] == [(0, 4), (4, 12)]
    stages = place(InstanceSpec(model="smollm3", min_nodes=3), facts, nodes)
    assert [(s.start, s.end) for s in stages] == [(0, 4), (4, 8), (8, 12)]
    for spec in (InstanceSpec(model="smollm3", min_nodes=4),
                 InstanceSpec(model="smollm3", nodes=list("abcd"))):  # fmt: skip
        with pytest.raises(PlacementError, match=r"cut only every 4 layers \(llama.cpp skips "
                           r"rope.*12 layers make at most 3 stage"):  # fmt: skip
            place(spec, facts, nodes)
    # Measured: cut at layer 1 instead, a later stage rotates layer 3 and not layer 4.
    prompt, (one, _) = whole_runs("smollm3")
    cut, _ = greedy([slice_stages("smollm3", 0, 1), slice_stages("smollm3", 1, 12)], prompt)
    assert cut != one

"""Other architectures through llama.cpp stages: a model cut in two gives what the
whole model gives, for shapes other than the default model's (attention biases, an
untied output head); and the one kind that cannot be cut is refused by placement.

The models are small GGUFs written here (random weights, the default model's
tokenizer): no download, and every tensor shape is the architecture's own.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from meshd.crdt.views import InstanceSpec
from meshd.domain.facts import ModelFacts
from meshd.engines.llama_stage import LlamaStage
from meshd.engines.stage import StageInput
from meshd.models.facts import read_facts
from meshd.models.hashing import file_sha256
from meshd.models.slicing import slice_gguf
from meshd.placement import PlacementError, place
from meshd.placement.resources import NodeResources
from tests.synthetic import N_LAYERS, write_model

pytestmark = pytest.mark.timeout(300)


def greedy(chain: list[LlamaStage], prompt: list[int], n: int = 8):
    """Greedy tokens and their logits through a chain of stages."""
    pos, cur, toks, logits = 0, np.asarray(prompt, np.int32), [], []
    for _ in range(n):
        x = chain[0].forward([StageInput(seq=0, pos=pos, tokens=cur)])[0]
        for s in chain[1:]:
            x = s.forward([StageInput(seq=0, pos=pos, hidden=x)])[0]
        pos += len(cur)
        tok = int(np.argmax(x))
        toks.append(tok)
        logits.append(x)
        cur = np.array([tok], np.int32)
    for s in chain:
        s.free(0)
    return toks, logits


PROMPT = "Once upon a time there was a little girl who lived in a village near the forest"


def whole_and_split(path: Path, cuts: tuple[int, ...]):
    """Greedy tokens and logits of the whole model and of its slices cut at ``cuts``."""
    sha = file_sha256(path)
    bounds = [0, *cuts, N_LAYERS]
    ranges = list(itertools.pairwise(bounds))
    slices = [slice_gguf(path, a, b, path.parent / "slices", sha) for a, b in ranges]
    whole = LlamaStage(path, first=True, last=True, n_ctx=256, n_seq_max=1, exact=True)
    split = [
        LlamaStage(p, first=i == 0, last=i == len(slices) - 1, n_ctx=256, n_seq_max=1,
                   exact=True)
        for i, p in enumerate(slices)
    ]  # fmt: skip
    try:
        prompt = whole.tokenize(PROMPT, add_special=False, parse_special=False)
        assert len(prompt) > 8  # longer than the sliding windows below
        return greedy([whole], prompt), greedy(split, prompt)
    finally:
        for s in [whole, *split]:
            s.close()


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


@pytest.mark.parametrize("cuts", [(1,), (1, 3)], ids=["2-stages", "3-stages"])
@pytest.mark.parametrize("case", list(MATRIX))
def test_a_model_cut_in_stages_gives_the_whole_models_logits(
    model_path: Path, tmp_path: Path, case: str, cuts: tuple[int, ...]
) -> None:
    arch, opts, meta = MATRIX[case]
    path = write_model(tmp_path / f"{arch}.gguf", model_path, arch, metadata=meta, **opts)
    (one, one_logits), (two, two_logits) = whole_and_split(path, cuts)
    assert two == one
    worst = max(float(np.abs(a - b).max()) for a, b in zip(one_logits, two_logits, strict=True))
    assert worst <= 1e-4, worst
    facts = read_facts(path, arch, sha256="0" * 64)
    nodes = {n: NodeResources(id=n, name=n, backends=["llama_cpp-cpu"], mem_available=1 << 40)
             for n in ("a", "b")}  # fmt: skip
    assert len(place(InstanceSpec(model=arch, min_nodes=2), facts, nodes)) == 2


def test_a_gemma2_slice_keeps_its_layers_window_flags(model_path: Path, tmp_path: Path) -> None:
    import gguf

    path = write_model(tmp_path / "g2.gguf", model_path, "gemma2",
                       metadata={"gemma2.attention.sliding_window": U(4)})  # fmt: skip
    part = slice_gguf(path, 1, 3, tmp_path / "slices", file_sha256(path))
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

"""Other architectures through llama.cpp stages: a model cut in two gives what the
whole model gives, for shapes other than the default model's (attention biases, an
untied output head); and the one kind that cannot be cut is refused by placement.

The models are small GGUFs written here (random weights, the default model's
tokenizer): no download, and every tensor shape is the architecture's own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshd.crdt.views import InstanceSpec
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


def whole_and_split(path: Path, cut: int):
    sha = file_sha256(path)
    slices = [
        slice_gguf(path, a, b, path.parent / "slices", sha) for a, b in [(0, cut), (cut, N_LAYERS)]
    ]
    whole = LlamaStage(path, first=True, last=True, n_ctx=256, n_seq_max=1, exact=True)
    split = [
        LlamaStage(p, first=i == 0, last=i == 1, n_ctx=256, n_seq_max=1, exact=True)
        for i, p in enumerate(slices)
    ]
    try:
        prompt = whole.tokenize(
            "Once upon a time there was", add_special=False, parse_special=False
        )
        return greedy([whole], prompt), greedy(split, prompt)
    finally:
        for s in [whole, *split]:
            s.close()


@pytest.mark.parametrize(
    ("arch", "bias", "tied"),
    [("qwen2", True, True), ("llama", False, False)],
    ids=["qwen2-attention-biases", "llama-untied-head"],
)
def test_a_model_cut_in_two_gives_the_whole_models_logits(
    model_path: Path, tmp_path: Path, arch: str, bias: bool, tied: bool
) -> None:
    path = write_model(tmp_path / f"{arch}.gguf", model_path, arch, bias=bias, tied=tied)
    (one, one_logits), (two, two_logits) = whole_and_split(path, cut=1)
    assert two == one
    worst = max(float(np.abs(a - b).max()) for a, b in zip(one_logits, two_logits, strict=True))
    assert worst <= 1e-4, worst


def test_a_gemma_model_is_not_cut_because_its_graph_rescales_the_input_rows(
    model_path: Path, tmp_path: Path
) -> None:
    path = write_model(tmp_path / "gemma.gguf", model_path, "gemma")
    # Why placement refuses: the second slice scales the hidden rows it is given by
    # sqrt(hidden) again, so the cut model is not the model.
    (_, one_logits), (_, two_logits) = whole_and_split(path, cut=2)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(one_logits, two_logits, strict=True))
    assert worst > 1e-2
    facts = read_facts(path, "gemma", sha256="0" * 64)
    assert facts.architecture == "gemma"
    nodes = {n: NodeResources(id=n, name=n, backends=["llama_cpp-cpu"], mem_available=1 << 40)
             for n in ("a", "b")}  # fmt: skip
    with pytest.raises(PlacementError, match="one node"):
        place(InstanceSpec(model="gemma", min_nodes=2), facts, nodes)
    assert len(place(InstanceSpec(model="gemma"), facts, nodes)) == 1

"""What a model allows placement: the engines that build it, and whether it may be cut.

**Engines.** A model is offered the engines its facts list (facts from before engines
were listed: the engine of its format), less those the rule of
:mod:`meshd.domain.builds` says cannot build its architecture from its format. Facts
read by this meshd list only engines the rule allows; the rule is applied here again
because facts also come from caches, peers and stored plans made by older ones.

**Splits.** A model is cut into stages only when its architecture is in
:data:`SPLIT_PROVEN`: a stage hands the next one the hidden rows only, and an
architecture whose graph does more to the rows a later stage receives (learned
position embeddings added again, an embedding norm applied again, per-layer inputs,
recurrent state) gives other text cut than whole, silently. Every other architecture
runs whole, on one node, and placement says why (:func:`split_refusal`). Some
proven architectures are cut only every few layers (:data:`CUT_PERIODS`,
:func:`stage_limit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from meshd.domain.builds import ENGINES, MLX_KV_REFUSAL, build_refusal
from meshd.domain.facts import ModelFacts

__all__ = [
    "CUT_PERIODS",
    "SPLIT_PROVEN",
    "backend_rank",
    "cut_period",
    "engine_of",
    "known_split_breaks",
    "model_engines",
    "node_engines",
    "refused_text",
    "split_refusal",
    "stage_holds_states",
    "stage_limit",
]

#: Architectures proven to split, by format: cut in 2 and in 3 stages they give the
#: whole model's greedy tokens and logits (within 1e-4). The proof lives in the tests,
#: which check they prove exactly these lists:
#:
#: - ``gguf`` (llama.cpp stages on sub-GGUF slices; a llama GGUF on MLX stages too):
#:   ``tests/engines/test_architectures.py`` (``CASES``), with llama also in
#:   ``tests/engines/test_llama_stage.py`` and ``test_mlx_stage.py``. Gemma's input
#:   scale and sliding-window flags, Granite's and MiniCPM's scales are undone or
#:   carried by the slices (``meshd.models.scaling``), as are gpt-oss's windowed layers
#:   and DeepSeek's count of dense first layers. A hybrid (lfm2, granitehybrid) is cut
#:   only where each stage holds both its kinds of layer (:func:`stage_holds_states`);
#:   smollm3 and llama4 only at multiples of their period (:data:`CUT_PERIODS`); a
#:   glm4moe slice after the first states rope sections to take hidden rows in
#:   (``meshd.models.scaling.hidden_rope_sections``).
#: - ``mlx`` (model folders on MLX stages): ``tests/engines/test_mlx_architectures.py``
#:   (``ARCHS``; an image-text gemma3 folder's facts say gemma3_text).
#:
#: An architecture joins a list with its case in that matrix, never before.
SPLIT_PROVEN: dict[str, frozenset[str]] = {
    "gguf": frozenset(
        {
            "gemma",
            "gemma2",
            "gemma3",
            "granite",
            "llama",
            "minicpm",
            "phi3",
            "qwen2",
            "qwen3",
            "qwen3moe",
            # Issue #32: what households run.
            "deepseek2",
            "glm4moe",
            "gpt-oss",
            "granitehybrid",
            "lfm2",
            "llama4",
            "mistral3",
            "olmo2",
            "smollm3",
        }
    ),
    "mlx": frozenset(
        {
            "gemma3_text",
            "llama",
            "mistral",
            "phi3",
            "qwen2",
            "qwen3",
        }
    ),
}

#: What llama.cpp's graph does to the rows a later stage receives, where it is known
#: (measured for gpt2: two stages answer other text than the whole model).
_SPLIT_BREAKS = {
    **dict.fromkeys(
        ("gpt2", "starcoder", "jais"),
        "llama.cpp adds its learned position embeddings again to the rows a later stage receives",
    ),
    "bloom": "llama.cpp normalizes the token embedding again on the rows a later stage receives",
    "gemma3n": "its graph feeds every layer per-layer embeddings (from the token ids) beside "
    "the hidden rows",
}


#: GGUF architectures whose llama.cpp graph sets a pattern over a layer's index in the
#: file, in code (no key a slice could restate), and the pattern's period: a slice
#: renumbers its layers from 0, so each stage starts at a multiple of the period.
#: Measured (tests/engines/test_architectures.py, 12 layers): smollm3 cut at layer 1
#: answers other tokens (max |logit difference| 27), at 4 and 8 the same; llama4 cut at
#: 1 or 2 aborts the process (its interleaved experts, 1 or 2 a period, divide 4 too).
CUT_PERIODS: dict[str, tuple[int, str]] = {
    "smollm3": (4, "llama.cpp skips rope on every 4th layer, counted from a stage's first"),
    "llama4": (
        4,
        "llama.cpp skips rope on every 4th layer and chunks attention on the 3 others, "
        "counted from a stage's first",
    ),
}


def cut_period(facts: ModelFacts) -> int:
    """Each stage of ``facts``' model starts at a multiple of this many layers (1: at
    any layer; see :data:`CUT_PERIODS`)."""
    if facts.format != "gguf":
        return 1
    return CUT_PERIODS.get(facts.architecture, (1, ""))[0]


def stage_limit(facts: ModelFacts) -> tuple[int, str]:
    """The most stages ``facts``' model may be cut into, and why no more, for a person
    ("" when each layer may be a stage): ``(1, "runs whole on one node: ...")``."""
    why = split_refusal(facts)
    if why is not None:
        return 1, f"runs whole on one node: {why}"
    period, n = cut_period(facts), facts.n_layers
    if period == 1:
        return n, ""
    k = -(-n // period)
    rule = CUT_PERIODS[facts.architecture][1]
    return k, f"is cut only every {period} layers ({rule}): {n} layers make at most {k} stage(s)"


def known_split_breaks() -> dict[str, str]:
    """Each GGUF architecture whose cut is known to change what it answers, and how."""
    return dict(_SPLIT_BREAKS)


def engine_of(backend: str) -> str:
    """``llama_cpp-cpu`` -> ``llama_cpp``; an engine name is returned as it is."""
    return backend.split("-", 1)[0]


def split_refusal(facts: ModelFacts) -> str | None:
    """Why ``facts``' model runs whole on one node, for a person; None when it may be
    cut into stages (see :data:`SPLIT_PROVEN`)."""
    if facts.embedding_only:
        return "an encoder (embeddings only) attends both ways over its whole input"
    arch = facts.architecture
    if arch in SPLIT_PROVEN.get(facts.format, frozenset()):
        return None
    known = _SPLIT_BREAKS.get(arch) if facts.format == "gguf" else None
    if known is not None:
        return known
    proven = ", ".join(sorted(SPLIT_PROVEN.get(facts.format, frozenset()))) or "none"
    return (
        f"no test has proven a {arch} model cut into stages gives what it gives whole "
        f"(proven for {proven})"
    )


def stage_holds_states(layer_state: str, start: int, end: int) -> bool:
    """Whether layers ``[start, end)`` of a model whose layers keep ``layer_state``
    (:attr:`~meshd.domain.facts.ModelFacts.layer_state`) hold a layer of each kind of
    state the model keeps: a hybrid's stage with no attention layer (or no recurrent
    one) has a memory llama.cpp never gives a buffer, and aborts the process at its
    first decode (measured on lfm2). True for a model of attention layers only ("")."""
    if not layer_state:
        return True
    part = layer_state[start:end]
    return all(
        any(c in kinds for c in part)
        for kinds in ("ab", "rb")
        if any(c in kinds for c in layer_state)
    )


def backend_rank(backend: str, preference: Sequence[str]) -> tuple[int, str]:
    """Sort key of a backend: its place in ``preference`` (fastest first), unlisted
    ones after every listed one, by name."""
    try:
        return (list(preference).index(backend), backend)
    except ValueError:
        return (len(preference), backend)


def node_engines(backends: Iterable[str], allowed: Sequence[str], pref: Sequence[str]) -> list[str]:
    """The engines of ``allowed`` a node with ``backends`` runs, best-ranked first."""
    out: list[str] = []
    for b in sorted(set(backends), key=lambda b: backend_rank(b, pref)):
        e = engine_of(b)
        if e in allowed and e not in out:
            out.append(e)
    return out


def model_engines(
    facts: ModelFacts, kv_cache: str = "f16"
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The engines placement may run ``facts``' model on with a ``kv_cache`` KV cache,
    in the facts' order, and each engine of :data:`~meshd.domain.builds.ENGINES` it may
    not, with why: ``(("llama_cpp",), (("mlx", "MLX reads GGUFs of ..."),))``."""
    listed = tuple(dict.fromkeys(engine_of(e) for e in facts.engines if e))
    if not listed:  # facts from before engines were listed
        listed = ("mlx",) if facts.format == "mlx" else ("llama_cpp",)
    offered: list[str] = []
    refused: list[tuple[str, str]] = []
    for e in dict.fromkeys((*listed, *ENGINES)):
        why = build_refusal(e, facts.format, facts.architecture)
        if why is None and e not in listed:
            why = f"it cannot read this {facts.format} file (its tensor types or layers)"
        if why is None and e == "mlx" and kv_cache != "f16":
            why = MLX_KV_REFUSAL.format(kv_cache=kv_cache)
        if why is None:
            offered.append(e)
        else:
            refused.append((e, why))
    return tuple(offered), tuple(refused)


def refused_text(refused: Iterable[tuple[str, str]], backends: Iterable[str]) -> str:
    """``"; mlx cannot run it: ..."`` for each refused engine that one of ``backends``
    runs (those are what a person expected it on), "" when none is."""
    have = {engine_of(b) for b in backends}
    return "".join(f"; {e} cannot run it: {why}" for e, why in refused if e in have)

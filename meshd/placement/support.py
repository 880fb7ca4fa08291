"""What a model allows placement: the engines that build it.

A model is offered the engines its facts list (facts from before engines were listed:
the engine of its format), less those the rule of :mod:`meshd.domain.builds` says
cannot build its architecture from its format. Facts read by this meshd list only
engines the rule allows; the rule is applied here again because facts also come from
caches, peers and stored plans made by older ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from meshd.domain.builds import ENGINES, build_refusal
from meshd.domain.facts import ModelFacts

__all__ = ["backend_rank", "engine_of", "model_engines", "node_engines", "refused_text"]


def engine_of(backend: str) -> str:
    """``llama_cpp-cpu`` -> ``llama_cpp``; an engine name is returned as it is."""
    return backend.split("-", 1)[0]


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


def model_engines(facts: ModelFacts) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The engines placement may run ``facts``' model on, in the facts' order, and each
    engine of :data:`~meshd.domain.builds.ENGINES` it may not, with why:
    ``(("llama_cpp",), (("mlx", "MLX reads GGUFs of ..."),))``."""
    listed = tuple(dict.fromkeys(engine_of(e) for e in facts.engines if e))
    if not listed:  # facts from before engines were listed
        listed = ("mlx",) if facts.format == "mlx" else ("llama_cpp",)
    offered: list[str] = []
    refused: list[tuple[str, str]] = []
    for e in dict.fromkeys((*listed, *ENGINES)):
        why = build_refusal(e, facts.format, facts.architecture)
        if why is None and e not in listed:
            why = f"it cannot read this {facts.format} file (its tensor types or layers)"
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

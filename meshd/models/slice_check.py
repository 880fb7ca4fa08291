"""What a fetched slice can be checked against without the model file: the model's
facts, which the instance records for every node (``ModelFacts``).

A node fetching a stage's slice lacks the whole file, so it cannot recompute the slice
or the file's sha256 (a plain sha256 says nothing about a part of the file). What it can
check before loading:

- the whole range ``[0, n_layers)`` *is* the file (``slice_gguf`` returns the source
  itself): its sha256 must be the one the plan names; a lie is caught whatever else;
- a part of a GGUF: its header must describe exactly that part of the model the facts
  describe: the architecture, width, vocabulary (size and the fingerprint of its token
  list), the layer count of the range, each layer's bytes, the embedding's and the
  head's bytes. A slice of another model, another quantization, other layers or another
  tokenizer fails; the same tensors with other values pass (only the holders' vote on
  the manifest root guards those: ``meshd.transport.weights_votes``).

An MLX folder slice is checked by the root alone.
"""

from __future__ import annotations

from pathlib import Path

from meshd.domain.facts import ModelFacts

from .facts import read_facts
from .hashing import file_sha256

__all__ = ["SliceMismatch", "check_slice"]


class SliceMismatch(ValueError):
    """A slice is not layers ``[start, end)`` of the model its facts describe."""


#: The facts a slice of a GGUF keeps from its model as they are.
_KEPT = ("architecture", "hidden_size", "n_ctx_train", "embed_bytes", "head_bytes", "n_vocab",
         "vocab_hash")  # fmt: skip


def check_slice(path: Path, facts: ModelFacts, start: int, end: int) -> None:
    """Raise :class:`SliceMismatch` unless ``path`` can be layers ``[start, end)`` of
    the model ``facts`` describe (see the module's doc for how far that goes)."""
    if facts.format != "gguf":
        return
    if start == 0 and end == facts.n_layers:
        got = file_sha256(Path(path))
        if got != facts.sha256:
            raise SliceMismatch(
                f"the whole model's sha256 is {got[:12]}, the plan names {facts.sha256[:12]}"
            )
        return
    try:
        # sha256 given: only the header is read.
        sliced = read_facts(Path(path), facts.name, sha256=facts.sha256)
    except Exception as e:  # a header that cannot be read is no slice, whatever the cause
        raise SliceMismatch(f"not a GGUF slice: {e}") from None
    expected = {k: getattr(facts, k) for k in _KEPT}
    expected["n_layers"] = end - start
    expected["layer_bytes"] = facts.layer_bytes[start:end]
    differ = [k for k, v in expected.items() if getattr(sliced, k) != v]
    if differ:
        raise SliceMismatch(
            f"its header is not layers [{start}, {end}) of the placed model "
            f"({', '.join(differ)} differ)"
        )

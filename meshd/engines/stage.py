"""The stage contract: what every engine's pipeline stage takes, returns and raises.

A stage runs layers ``[start, end)`` of one model for up to ``n_seq_max`` requests at
once, each a sequence with its own KV cache. A first stage takes token ids; any other
takes the float32 hidden rows the stage before it produced. A stage that is not last
returns the residual stream after its last layer; the last stage returns logits. Every
engine (:mod:`~meshd.engines.llama_stage`, :mod:`~meshd.engines.mlx_stage`) implements
:class:`Stage` and checks its inputs with :func:`validate_inputs`, so a pipeline may
mix engines and a runner drives them all the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = [
    "ContextFullError",
    "Stage",
    "StageError",
    "StageInput",
    "StageInputError",
    "StageOutput",
    "Threaded",
    "check_seq",
    "set_threads",
    "stage_role",
    "validate_inputs",
]


class StageError(RuntimeError):
    """llama.cpp failed to load the model or to decode a batch."""


class StageInputError(ValueError):
    """A request handed to a stage does not fit it (wrong kind, shape, position...)."""


class ContextFullError(StageInputError):
    """A request would grow past the stage's per-sequence context (``n_ctx``)."""


@dataclass(frozen=True, slots=True)
class StageInput:
    """One request's rows for one decode step.

    ``pos`` is the absolute position of the first row; it must equal the number of
    positions the stage already holds for ``seq`` (see :meth:`LlamaStage.n_past`).
    A first stage takes ``tokens`` (int32, shape ``(n,)``), any other stage takes
    ``hidden`` (float32, shape ``(n, hidden_size)``). ``n_logits``: on a last stage,
    the logits of this many last rows, ``(n_logits, n_vocab)`` when more than one (a
    speculative step verifies every drafted row).
    """

    seq: int
    pos: int
    tokens: npt.NDArray[np.int32] | None = None
    hidden: npt.NDArray[np.float32] | None = None
    n_logits: int = 1

    @property
    def n_rows(self) -> int:
        """Number of positions this input covers."""
        if self.tokens is not None:
            return len(self.tokens)
        if self.hidden is not None:
            return len(self.hidden)
        return 0


#: What a stage returns for one request, in the order of the inputs: on a stage that
#: is not last, its hidden rows (float32, ``(n, hidden_size)``, the residual stream
#: after the stage's last layer); on the last stage, the logits of its last row
#: (float32, ``(n_vocab,)``). The arrays are the caller's: the stage never writes
#: into them again.
StageOutput: TypeAlias = npt.NDArray[np.float32]


class Stage(Protocol):
    """One pipeline stage of one model, as a runner drives it (not thread-safe)."""

    first: bool
    last: bool
    n_vocab: int
    hidden_size: int
    #: Context each sequence may hold, and how many sequences the stage holds.
    n_ctx: int
    n_seq_max: int
    #: Context the model was trained for (0 when unknown).
    n_ctx_train: int
    #: False for an encoder (embeddings only): :meth:`forward` is not for it.
    generative: bool
    #: True for a model with recurrent layers (one state per sequence, see
    #: :mod:`meshd.domain.recurrent`): :meth:`truncate` and :meth:`share` take only a
    #: sequence's whole length, so the runner neither speculates nor reuses prefixes.
    recurrent: bool

    @property
    def kept_rows(self) -> int | None:
        """Rows of other work after which KV kept for no request (a cached prefix) has
        cost what computing it again would; None where keeping it costs no time (each
        sequence has caches of its own)."""
        ...

    def n_past(self, seq: int) -> int:
        """Positions the stage holds for ``seq``."""
        ...

    def free(self, seq: int) -> None:
        """Drop ``seq``'s KV cache (idempotent)."""
        ...

    def share(self, src: int, dst: int, n: int) -> None:
        """Make the empty ``dst`` hold ``src``'s first ``n`` positions, as if it had
        run the same input (``n`` choices of one prompt prefill it once)."""
        ...

    def truncate(self, seq: int, n: int) -> None:
        """Keep only ``seq``'s first ``n`` positions (a request that starts from a
        cached prefix takes over the sequence that holds it)."""
        ...

    def forward(self, items: Sequence[StageInput]) -> list[StageOutput]:
        """Run one step for every item (one per sequence), in one engine call."""
        ...

    def embed(self, items: Sequence[StageInput]) -> list[npt.NDArray[np.float32]]:
        """Last stage: for each item, the final hidden states (after the output norm),
        ``(n, hidden_size)``, of one whole input; computed together, apart from every
        sequence (no KV is kept or touched; ``seq`` and ``pos`` are not used)."""
        ...

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of ``text`` in the model's vocabulary."""
        ...

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for."""
        ...

    def eos_tokens(self) -> set[int]:
        """Ids that end a generation."""
        ...

    def special_texts(self) -> tuple[str, str]:
        """The BOS and EOS token texts chat templates get."""
        ...

    def close(self) -> None:
        """Free the engine's memory."""
        ...


@runtime_checkable
class Threaded(Protocol):
    """A stage whose engine computes with a number of CPU threads that may change
    between steps (llama.cpp; MLX has no such setting: it runs on the GPU)."""

    def set_threads(self, n: int) -> int:
        """Use ``n`` threads from the next step on; the count the engine now holds."""
        ...


def set_threads(stage: object, n: int) -> int:
    """Have ``stage`` compute with ``n`` CPU threads, where its engine can; the count it
    holds now (0: its engine has no such setting)."""
    return stage.set_threads(n) if isinstance(stage, Threaded) else 0


def stage_role(first: bool, last: bool) -> str:
    """``first+last``, ``first``, ``last`` or ``middle``: a stage's place, for reprs."""
    if first:
        return "first+last" if last else "first"
    return "last" if last else "middle"


def check_seq(seq: int, n_seq_max: int) -> None:
    """Raise StageInputError for a seq id outside ``[0, n_seq_max)``."""
    if not 0 <= seq < n_seq_max:
        raise StageInputError(f"seq {seq} outside [0, {n_seq_max})")


def input_rows(stage: Stage, tokens: np.ndarray | None, hidden: np.ndarray | None) -> np.ndarray:
    """One input as the engine takes it: int32 token ids on a first stage, float32
    ``(n, hidden)`` rows elsewhere and, in place of token embeddings, on a first stage
    too (an image's rows); StageInputError for anything else."""
    if stage.first and not (tokens is None and hidden is not None):
        if tokens is None or hidden is not None:
            raise StageInputError("a first stage takes tokens, or embedding rows alone")
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise StageInputError(f"tokens must be a 1-D int array, got {arr.dtype}")
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= stage.n_vocab):
            raise StageInputError(f"token id outside [0, {stage.n_vocab})")
        return arr.astype(np.int32, copy=False)
    if hidden is None or tokens is not None:
        raise StageInputError("this stage takes hidden rows, not tokens")
    arr = np.asarray(hidden)
    if arr.ndim != 2 or arr.shape[1] != stage.hidden_size:
        raise StageInputError(f"hidden must be (n, {stage.hidden_size}), got {arr.shape}")
    # float32 on the way in: f16/bf16 rows cost ~4e-3/1e-2 in logits.
    return arr.astype(np.float32, copy=False)


def validate_embed_inputs(stage: Stage, items: Sequence[StageInput]) -> list[np.ndarray]:
    """The rows of each :meth:`Stage.embed` input (last stage only)."""
    if not stage.last:
        raise StageInputError("only a last stage computes embeddings")
    out = []
    for it in items:
        arr = input_rows(stage, it.tokens, it.hidden)
        if len(arr) == 0:
            raise StageInputError("empty input")
        if len(arr) > stage.n_ctx:
            raise ContextFullError(f"{len(arr)} positions exceed n_ctx {stage.n_ctx}")
        out.append(arr)
    return out


def validate_inputs(stage: Stage, items: Sequence[StageInput]) -> list[np.ndarray]:
    """Check every item for ``stage`` before anything runs; return its input as arrays.

    One rule book for every engine: tokens on a first stage (or rows that stand for
    token embeddings there: an image's), ``(n, hidden)`` rows elsewhere, each seq
    once, ``pos`` equal to what the stage holds, within ``n_ctx``.
    """
    seen: set[int] = set()
    inputs: list[np.ndarray] = []
    for it in items:
        check_seq(it.seq, stage.n_seq_max)
        if it.seq in seen:
            raise StageInputError(f"seq {it.seq} appears twice in one forward")
        seen.add(it.seq)
        arr = input_rows(stage, it.tokens, it.hidden)
        n = len(arr)
        if n == 0:
            raise StageInputError(f"seq {it.seq}: empty input")
        past = stage.n_past(it.seq)
        if it.pos != past:
            raise StageInputError(f"seq {it.seq}: pos {it.pos} but the stage holds {past}")
        if not 1 <= it.n_logits <= n:
            raise StageInputError(f"seq {it.seq}: n_logits {it.n_logits} of {n} rows")
        if it.pos + n > stage.n_ctx:
            raise ContextFullError(
                f"seq {it.seq}: {it.pos} + {n} positions exceed n_ctx {stage.n_ctx}"
            )
        inputs.append(arr)
    return inputs

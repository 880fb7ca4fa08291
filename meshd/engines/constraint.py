"""A request's grammar at the last stage: the vocabulary as llguidance reads it and the
token mask over the logits (see :mod:`meshd.engines.grammar` for the grammars
themselves).

Apart from the grammars because it needs numpy and a vocabulary: the API node checks
grammars (:func:`~meshd.engines.grammar.check_grammar`) and starts without either.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import llguidance
import numpy as np

from meshd.engines.grammar import LIMITS, GrammarError

__all__ = ["Constraint", "GrammarVocab"]


class _Vocabulary(Protocol):
    n_vocab: int

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes: ...

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def eos_tokens(self) -> set[int]: ...


class GrammarVocab:
    """A stage's vocabulary as llguidance reads it (built once per runner: ~0.3 s on a
    49k vocabulary, so it is made on the first constrained request)."""

    def __init__(self, vocab: _Vocabulary) -> None:
        """Read every token's bytes through the stage contract."""
        tokens: list[bytes] = []
        for t in range(vocab.n_vocab):
            shown = vocab.token_to_piece(t, special=True)
            # A control token renders as nothing unless asked for; llguidance wants it
            # marked with a 0xff prefix, so the grammar's text never matches it.
            plain = vocab.token_to_piece(t)
            tokens.append(b"\xff" + shown if shown and not plain else shown)
        eos = sorted(vocab.eos_tokens())
        #: Each token's bytes (control tokens behind a 0xff byte).
        self.tokens = tokens
        self.n_vocab = vocab.n_vocab
        self.eos = set(eos)

        class _Source:
            eos_token_id = eos[0] if eos else 0
            bos_token_id = None

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, text: bytes) -> list[int]:
                return vocab.tokenize(text.decode("utf-8", "replace"), False, False)

        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Source()), eos_token=eos or None
        )


class Constraint:
    """One request's grammar state at the last stage."""

    def __init__(self, vocab: GrammarVocab, grammar: str, history: Iterable[int] = ()) -> None:
        """Compile ``grammar`` and walk it over ``history`` (a replay's tokens already
        sent). :class:`GrammarError` if it does not compile or refuses the history."""
        self._vocab = vocab
        self._m = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0, limits=LIMITS)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())
        self._bits = np.zeros((vocab.n_vocab + 31) // 32, np.int32)
        for tok in history:
            if tok not in vocab.eos:
                self.accept(tok)

    @property
    def done(self) -> bool:
        """True when the grammar allows no further token (the output is complete)."""
        return self._m.is_stopped()

    def allowed(self) -> np.ndarray:
        """A boolean vector over the vocabulary: the tokens the grammar takes next."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[: self._vocab.n_vocab].view(np.bool_)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with the tokens the grammar refuses at ``-inf``; logits
        past the vocabulary (a padded output layer) are refused too."""
        out = np.array(logits, dtype=np.float32)
        ok = self.allowed()
        n = min(out.size, ok.size)
        out[:n][~ok[:n]] = -np.inf
        out[n:] = -np.inf
        return out

    def accept(self, token: int) -> None:
        """Advance over ``token``; :class:`GrammarError` if the grammar refuses it."""
        if not self._m.consume_token(int(token)):
            raise GrammarError(
                f"token {token} breaks the grammar: {self._m.get_error() or 'not allowed'}"
            )

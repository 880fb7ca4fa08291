"""llama.cpp in this process: its library loaded once (with its log kept in ours),
and a GGUF's vocabulary through it (:class:`LlamaVocab`, which every engine tokenizes
with). :mod:`meshd.engines.llama_stage` runs layers on top of this."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

from .ggml_lib import Ggml, cpu_extra_buffer_types
from .stage import StageError

__all__ = ["LlamaVocab"]

log = logging.getLogger("meshd.engines.llama")


class _Backend:
    """llama_cpp and ggml, loaded once per process on first use."""

    def __init__(self) -> None:
        # Imported here, not at module import: see configure_threads().
        import llama_cpp

        self.L: Any = llama_cpp
        # Held for the life of the process: llama.cpp keeps only the C pointer.
        self.log_cb = llama_cpp.llama_log_callback(_llama_log)
        llama_cpp.llama_log_set(self.log_cb, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self.ggml = Ggml(llama_cpp)
        #: Whether this build packs weights for Intel AMX (see LlamaStage.__init__).
        self.amx = "AMX" in cpu_extra_buffer_types(llama_cpp)
        if self.amx:
            log.warning(
                "this llama.cpp build uses Intel AMX, whose matmul crashes (llama.cpp "
                "#20824): stages load without repacked weights; `./install.sh` on this "
                "machine builds llama-cpp-python without AMX"
            )


#: ggml_log_level in this llama.cpp: 1 debug, 2 info, 3 warn, 4 error, 5 continuation.
#: (llama_cpp._logger still maps the older 1 info / 2 warn / 3 error numbering.)
_LOG_LEVELS = {3: logging.WARNING, 4: logging.ERROR}
_backend: _Backend | None = None


#: Warnings that say nothing true about a stage: with one unified KV cache for all
#: sequences llama.cpp compares the whole cache (n_ctx x n_seq_max cells) with the
#: trained context, while each request is capped at the trained context by the runner.
_QUIET = (b"possible training context overflow",)


def _llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs every tensor it loads at INFO/DEBUG; a runner keeps only warnings
    # and errors, in its own log rather than on stderr.
    py_level = _LOG_LEVELS.get(level)
    if py_level is not None and text and not any(q in text for q in _QUIET):
        log.log(py_level, "%s", text.decode("utf-8", "replace").rstrip())


def _get_backend() -> _Backend:
    global _backend
    if _backend is None:
        _backend = _Backend()
    return _backend


class LlamaVocab:
    """A GGUF's vocabulary through llama.cpp: tokenize, pieces, end-of-generation ids.

    Every engine tokenizes through this, so token ids, pieces and stop ids agree across
    llama.cpp and MLX stages. :meth:`load` reads only the vocabulary of a file
    (``vocab_only``); a LlamaStage passes the vocabulary of the model it loaded.
    """

    def __init__(self, L: Any, vocab: Any, model: Any = None) -> None:
        self._L = L
        self._vocab = vocab
        #: Owned vocab-only model, freed by :meth:`close` (None when borrowed).
        self._model = model
        self.n_vocab = int(L.llama_vocab_n_tokens(vocab))
        self._eos: set[int] | None = None

    @classmethod
    def load(cls, path: Path) -> LlamaVocab:
        """The vocabulary of the GGUF at ``path``, without reading any tensor."""
        L = _get_backend().L
        params = L.llama_model_default_params()
        params.vocab_only = True
        model = L.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise StageError(f"llama.cpp could not read the vocabulary of {path}")
        return cls(L, L.llama_model_get_vocab(model), model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of ``text`` (see :meth:`LlamaStage.tokenize`)."""
        data = text.encode("utf-8")
        n_max = len(data) + 8
        while True:
            buf = (self._L.llama_token * n_max)()
            n = int(
                self._L.llama_tokenize(
                    self._vocab, data, len(data), buf, n_max, add_special, parse_special
                )
            )
            if n >= 0:
                return list(buf[:n])
            # A negative count is the size the result needs.
            n_max = -n

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (see :meth:`LlamaStage.token_to_piece`)."""
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = int(self._L.llama_token_to_piece(self._vocab, token, buf, size, 0, special))
            if n >= 0:
                return buf.raw[:n]
            size = -n

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text (what chat templates get as ``bos_token``), or None."""
        return self._special_text(int(self._L.llama_vocab_bos(self._vocab)))

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text (what chat templates get as ``eos_token``), or None."""
        return self._special_text(int(self._L.llama_vocab_eos(self._vocab)))

    def _special_text(self, token: int) -> str | None:
        # The token's text as the vocabulary stores it ("<|im_start|>", "<s>"), which is
        # what llama-cpp-python passes to templates; its piece would render as nothing.
        if token < 0:
            return None
        text = self._L.llama_vocab_get_text(self._vocab, token)
        return text.decode("utf-8", errors="replace") if text else None

    def eos_tokens(self) -> set[int]:
        """eos, eot and every token llama.cpp marks end-of-generation (scanned once)."""
        if self._eos is None:
            L, v = self._L, self._vocab
            eos = {int(t) for t in (L.llama_vocab_eos(v), L.llama_vocab_eot(v)) if t >= 0}
            # Chat end-of-turn tokens (<|im_end|>, <|eot_id|>...) are found by their text.
            eos.update(i for i in range(self.n_vocab) if L.llama_vocab_is_eog(v, i))
            self._eos = eos
        return set(self._eos)

    def close(self) -> None:
        """Free an owned vocab-only model. Safe to call twice."""
        if self._model is not None:
            self._L.llama_model_free(self._model)
            self._model = None

"""Streaming text out of a token stream: incremental detokenization and stop strings.

Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM) split one character over several
tokens: an emoji is four bytes and may arrive as four tokens. Decoding each token on its
own would put U+FFFD into the stream, so :class:`IncrementalDetokenizer` holds an
incomplete UTF-8 tail back until the token that completes it arrives.

:class:`StopMatcher` then cuts the text at the first stop string. A stop string may
also arrive split over several chunks ("<|e" + "nd|>"), so a tail that could still
become a stop string is held back until the next chunk settles it.

:class:`TextStream` chains the two for one request and owns the end-of-stream rule:
whatever ends the stream (an end-of-generation token, ``max_tokens``, a full context),
the text held back is released, except past a stop string, where the text ends just
before it (OpenAI's semantics).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Sequence

__all__ = ["MAX_STOPS", "IncrementalDetokenizer", "StopMatcher", "TextStream", "showing"]

MAX_STOPS = 16
"""Most stop strings in one request (OpenAI allows 4; Anthropic and Ollama clients may
send more; matching cost grows with the count)."""


def showing(piece: Callable[..., bytes], shown: Iterable[int]) -> Callable[[int], bytes]:
    """A token's bytes by ``piece`` (a stage's ``token_to_piece``), the control tokens
    in ``shown`` as their text where the others render as nothing."""
    ids = frozenset(shown)
    if not ids:
        return piece
    return lambda token: piece(token, special=token in ids)


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive, never emitting a broken character.

    ``piece`` maps a token id to its raw bytes (llama.cpp's ``llama_token_to_piece``, or
    a byte-level BPE table). The concatenation of every :meth:`push` and the final
    :meth:`flush` equals ``b"".join(pieces).decode("utf-8", errors="replace")``.
    """

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self._piece = piece
        # The stdlib incremental decoder keeps an unfinished multi-byte sequence
        # between calls and replaces invalid bytes exactly as a one-shot decode does.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        return self._decoder.decode(self._piece(token), final=False)

    def flush(self) -> str:
        """End of stream: return what was held back, invalid bytes as U+FFFD."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class StopMatcher:
    """Cuts a text stream before the first occurrence of any stop string.

    :meth:`push` returns ``(text, stopped)``: the text that is now safe to emit and
    whether a stop string was hit. The stop string itself is never emitted, nor anything
    after it. When stop strings overlap, the one that completes first in the stream wins
    (the one starting first, if they complete together), so the result does not depend
    on how the stream was chunked. With no stop strings every chunk passes straight on.
    """

    def __init__(self, stops: str | Sequence[str] | None = None) -> None:
        """``stops``: up to :data:`MAX_STOPS` non-empty strings (a lone str is one stop)."""
        if stops is None:
            stops = []
        elif isinstance(stops, str):
            stops = [stops]
        stops = list(stops)
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings are allowed, got {len(stops)}")
        for stop in stops:
            if not isinstance(stop, str):
                raise TypeError(f"stop strings must be str, got {type(stop).__name__}")
            if not stop:
                raise ValueError("stop strings must not be empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.matched: str | None = None
        """The stop string that ended the stream, once one has."""
        self._held = ""

    @property
    def stopped(self) -> bool:
        """True once a stop string has been hit; later pushes return ("", True)."""
        return self.matched is not None

    def push(self, text: str) -> tuple[str, bool]:
        """Add a chunk; return the text now safe to emit and whether a stop was hit."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        hit = self._first_hit(buf)
        if hit is not None:
            start, stop = hit
            self.matched = stop
            self._held = ""
            return buf[:start], True
        hold = self._partial_tail(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of stream: the held-back tail turned out not to be a stop string."""
        text, self._held = self._held, ""
        return text

    def _first_hit(self, buf: str) -> tuple[int, str] | None:
        # Earliest end, then earliest start: what a token-by-token reader would see first.
        # Only the first occurrence of each stop can be the earliest to end.
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = buf.find(stop)
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand < best:
                    best = cand
        return None if best is None else (best[1], best[2])

    def _partial_tail(self, buf: str) -> int:
        # Longest suffix of buf that is a proper prefix of some stop string: text before
        # it cannot be the start of a stop (that occurrence would be a longer such suffix).
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class TextStream:
    """One request's output text: token ids in, emit-safe text out.

    The concatenation of every :meth:`push` and the final :meth:`finish` is the
    whole generated text (as :class:`IncrementalDetokenizer` decodes it) cut before
    the first stop string, whether the stream ended on a stop string or not.
    """

    def __init__(self, piece: Callable[[int], bytes], stops: Sequence[str] = ()) -> None:
        """``piece``: token id -> raw bytes; ``stops``: the request's stop strings."""
        self._detok = IncrementalDetokenizer(piece)
        self._stops = StopMatcher(list(stops))

    @property
    def stopped(self) -> bool:
        """True once a stop string has ended the text."""
        return self._stops.stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._stops.matched

    def prime(self, tokens: Sequence[int]) -> None:
        """Feed tokens whose text the client already has (a replay), discarding it:
        held-back bytes and partial stop strings then continue exactly."""
        for token in tokens:
            self.push(token)

    def push(self, token: int) -> tuple[str, bool]:
        """Add one token; return the text now safe to emit and whether a stop hit."""
        return self._stops.push(self._detok.push(token))

    def finish(self) -> str:
        """End of stream: the text still held back (unfinished UTF-8 bytes as U+FFFD, a
        tail that could have begun a stop string), cut at a stop string if those last
        bytes complete one. "" after a stop string."""
        if self._stops.stopped:
            return ""
        text, stopped = self._stops.push(self._detok.flush())
        return text if stopped else text + self._stops.flush()

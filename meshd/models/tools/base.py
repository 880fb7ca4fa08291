"""What every tool-call format shares: a parsed call, the pieces a reader emits, JSON
helpers, and :class:`BlockReader`, the streaming loop most formats read with.

Most formats mark a call with an opening string (``<tool_call>``, ``<|tool_call|>``,
``<|START_ACTION|>`` ...). A :class:`BlockReader` shows the text before an opener
as it streams, holds only a tail that may still become one, and hands each block
that starts with an opener to the format's :data:`Block` function, which says how
much of it is settled and what it gives (calls, or text given back)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "Block",
    "BlockReader",
    "ParsedCall",
    "Part",
    "Reader",
    "Tools",
    "call_of",
    "emit",
    "loads",
    "named_call",
    "partial_suffix",
    "section",
]

#: The functions a request offers, each ``{"name", "description"?, "parameters"?}``.
Tools = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class ParsedCall:
    """One function call read from a model's output."""

    name: str
    #: The arguments as a JSON text (OpenAI's ``function.arguments``).
    arguments: str


#: What a reader gives: text for the user, or a call.
Part = str | ParsedCall


class Reader(Protocol):
    """A format's reader of one answer, fed as it streams."""

    def feed(self, text: str) -> list[Part]:
        """What of the output so far can be shown after ``text``."""
        ...

    def finish(self) -> list[Part]:
        """Everything still held, once the output has ended."""
        ...


def loads(text: str) -> Any:
    """``text`` as JSON, or None if it is not JSON."""
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


def named_call(name: Any, args: Any) -> ParsedCall | None:
    """The call of ``name`` with ``args`` (a mapping, or a JSON text of one), or None
    if either is not what a call holds."""
    if not isinstance(name, str) or not name.strip():
        return None
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        return None
    return ParsedCall(name.strip(), json.dumps(args, ensure_ascii=False))


def call_of(obj: Any, name_key: str = "name", args_keys: Sequence[str] = ()) -> ParsedCall | None:
    """The call a JSON object describes: its name under ``name_key``, its arguments
    under the first of ``args_keys`` it has (default ``arguments`` then
    ``parameters``), or None if it is no call."""
    if not isinstance(obj, dict):
        return None
    for key in args_keys or ("arguments", "parameters"):
        if key in obj:
            return named_call(obj.get(name_key), obj[key])
    return named_call(obj.get(name_key), {})


def emit(out: list[Part], text: str) -> None:
    """Append ``text`` to ``out`` unless it is empty."""
    if text:
        out.append(text)


def partial_suffix(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of
    ``tags``: what must be held, since the next piece may complete a tag."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


#: A format's reading of one block: ``text`` starts with one of its openers; the
#: answer is ``(n, parts)``, the first ``n`` (at least 1) characters settled into
#: ``parts``, or None while more text is needed to decide (never when ``final``,
#: the output having ended).
Block = Callable[[str, bool], "tuple[int, list[Part]] | None"]


class BlockReader:
    """Streams text through, handing each block that starts with one of ``openers``
    to ``block``. A block that is no call is given back as text by ``block``, so
    nothing the model wrote is lost."""

    def __init__(self, openers: Sequence[str], block: Block) -> None:
        """``openers``: the strings a block may start with; ``block``: how one reads."""
        self._openers = tuple(openers)
        self._block = block
        self._held = ""

    def feed(self, text: str) -> list[Part]:
        """What of the output so far can be shown after ``text``."""
        self._held += text
        return self._scan(final=False)

    def finish(self) -> list[Part]:
        """Everything still held, once the output has ended."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while True:
            found = [i for i in (self._held.find(o) for o in self._openers) if i >= 0]
            if not found:
                break
            start = min(found)
            emit(out, self._held[:start])
            self._held = self._held[start:]
            read = self._block(self._held, final)
            if read is None:  # inside a block: wait for the rest of it
                return out
            n, parts = read
            out += parts
            self._held = self._held[max(n, 1) :]
        keep = 0 if final else partial_suffix(self._held, self._openers)
        emit(out, self._held[: len(self._held) - keep])
        self._held = self._held[len(self._held) - keep :]
        return out


def section(begin: str, end: str, call_begin: str, one: Block) -> Block:
    """The :data:`Block` of a format that groups its calls in a section between
    ``begin`` and ``end``, each call opening with ``call_begin`` and read by ``one``
    (which also reads a call the model wrote without its section). A section is read
    whole: if any of its calls does not parse, all of it is given back as text."""

    def block(text: str, final: bool) -> tuple[int, list[Part]] | None:
        if not text.startswith(begin):
            return one(text, final)
        stop = text.find(end)
        if stop < 0 and not final:
            return None
        n = len(text) if stop < 0 else stop + len(end)
        head, *pieces = text[len(begin) : stop if stop >= 0 else n].split(call_begin)
        calls: list[Part] = []
        for piece in pieces:
            read = one(call_begin + piece, True)
            if read is None or read[0] < len(call_begin + piece.rstrip()):
                return n, [text[:n]]
            calls += read[1]
        if head.strip() or not pieces or not all(isinstance(c, ParsedCall) for c in calls):
            return n, [text[:n]]
        return n, calls

    return block

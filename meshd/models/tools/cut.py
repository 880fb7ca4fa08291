"""The end of an answer that the token limit (``max_tokens``) cut inside a call.

A call whose arguments are not whole cannot run, and the markup it began with (the
format's opener, or the JSON of a Llama 3 or Mistral call) is no text for the user:
the answer ends before it. A reader reads what is still open at the end of an answer
leniently (a model's own end may close a call), so a call it reads only then, from a
cut, is dropped: its last argument may be cut too. A Hermes call whose arguments are
whole JSON, only its closing tag cut, is still a call. Pure: what is kept depends on
the text alone."""

from __future__ import annotations

from .base import Part, Tools
from .formats import FORMATS, ToolFormat
from .hermes import HERMES_CLOSE, HERMES_OPEN

__all__ = ["after_cut"]

#: Formats whose calls are the whole answer, written as JSON.
_JSON_ANSWER = frozenset({"llama3", "mistral"})
#: Formats whose call, once its arguments are whole, needs only its closing tag.
_CLOSABLE = frozenset({"hermes", "generic"})


def after_cut(fmt: ToolFormat, held: list[Part], head: str, tools: Tools = ()) -> list[Part]:
    """What of ``held`` (what a reader gave when a cut answer ended) is kept: the text
    before a cut call, and that call where it can run. ``head`` is the answer's first
    character that is not a space; ``tools`` the functions offered."""
    if fmt not in _JSON_ANSWER and fmt not in _CLOSABLE:
        held = [p for p in held if isinstance(p, str)]
    last = held[-1] if held else None
    if not isinstance(last, str):
        return held
    return held[:-1] + _rest(fmt, last, head, tools)


def _rest(fmt: ToolFormat, rest: str, head: str, tools: Tools) -> list[Part]:
    """What of the text ``rest`` at the end of a cut answer is kept."""
    if fmt in _JSON_ANSWER:
        if head not in ("{", "[") or not _begins_call(rest):
            return [rest]
        # A Mistral list may lack only its "]".
        return _calls(fmt, rest + "]", tools)
    opener = _opener(fmt)
    if opener is None:
        return [rest]
    start = rest.rfind(opener)
    if start < 0:  # maybe cut inside the opener itself ("...<tool_c")
        return [_without_partial(rest, opener)]
    if fmt in _CLOSABLE and HERMES_CLOSE not in rest[start:]:
        block = _without_partial(rest[start:].rstrip(), HERMES_CLOSE)
        return [rest[:start], *_calls(fmt, block + HERMES_CLOSE, tools)]
    return [rest[:start]]


def _opener(fmt: ToolFormat) -> str | None:
    """The string a call of ``fmt`` starts with; None where a call has no opener of
    its own (gpt-oss's is a message header, Command R's a line of prose)."""
    if fmt in _CLOSABLE:
        return HERMES_OPEN
    if fmt in ("harmony", "command_r"):
        return None
    markers = FORMATS[fmt].markers
    return markers[0] if markers else None


def _begins_call(text: str) -> bool:
    """Whether ``text`` is the start of a call written as JSON, as far as it came:
    ``{"name"`` (in a list, for Mistral), or a cut anywhere before its end (``{"na``)."""
    s = text.lstrip().removeprefix("[").lstrip()
    if not s.startswith("{"):
        return not s
    key = s[1:].lstrip()
    return key.startswith('"name"') or '"name"'.startswith(key)


def _calls(fmt: ToolFormat, text: str, tools: Tools) -> list[Part]:
    """The calls in ``text`` read whole by a reader of its own; no text."""
    reader = FORMATS[fmt].reader(tools)
    return [p for p in reader.feed(text) + reader.finish() if not isinstance(p, str)]


def _without_partial(text: str, tag: str) -> str:
    """``text`` without a proper prefix of ``tag`` at its end (a tag the cut split)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text

"""The two things every format is used for: reading calls from an answer as it
streams (:class:`ToolCallParser`, for every API dialect, so the rules are written
once) and the grammar that forces one call (:func:`forced_call_lark`)."""

from __future__ import annotations

from collections.abc import Mapping

from .base import Part, Tools
from .cut import after_cut
from .formats import FORMATS, ToolFormat
from .grammar import Marks, picked

__all__ = ["ToolCallParser", "forced_call_lark", "tool_markers"]


class ToolCallParser:
    """Splits a model's output, as it streams, into text for the user and tool calls.

    :meth:`feed` takes each new piece of text and returns what can be shown now: strings
    (content) and :class:`~.base.ParsedCall` s, in order; text that may still turn out
    to be part of a call is held. :meth:`finish` returns the rest. A call that does not
    parse is given back as text, so nothing the model wrote is lost.
    """

    def __init__(self, fmt: ToolFormat, tools: Tools = ()) -> None:
        """``fmt``: the model's tool format (:func:`~.formats.tool_format`); ``tools``:
        the functions offered (``{"name", "parameters"}`` each), whose schemas type
        arguments the format writes as raw text."""
        self.fmt = fmt
        self._tools = tools
        self._reader = FORMATS[fmt].reader(tools)
        #: The answer's first character that is not a space ("" until one came).
        self._head = ""

    def feed(self, text: str) -> list[Part]:
        """What of the output so far can be shown after ``text``."""
        if not self._head:
            self._head = text.lstrip()[:1]
        return self._reader.feed(text)

    def finish(self, cut: bool = False) -> list[Part]:
        """Everything still held, once the output has ended; ``cut``: the token limit
        ended it, so a call it cut short is dropped, markup and all (:mod:`.cut`)."""
        parts = self._reader.finish()
        return after_cut(self.fmt, parts, self._head, self._tools) if cut else parts


def forced_call_lark(
    tools: Tools,
    fmt: ToolFormat,
    name: str | None = None,
    specials: Mapping[str, int] | None = None,
) -> str:
    """A Lark grammar (llguidance's dialect) whose every sentence is one call, in the
    model's format, of ``name`` (None: any of ``tools``) with arguments valid under its
    schema (``tool_choice`` ``required`` or a named function). ``specials`` maps the
    format's markers that are control tokens of the model to their ids
    (:func:`~.grammar.control_tokens`); the others are written as text.

    Raises ValueError when no tool is left to call."""
    if not picked(tools, name):
        raise ValueError(f"no tool named {name!r} to call" if name else "no tool to call")
    return FORMATS[fmt].lark(tools, name, Marks(specials))


def tool_markers(fmt: ToolFormat) -> tuple[str, ...]:
    """The markers of ``fmt`` that the answer must show as text where they are
    control tokens of the model (the last stage renders those tokens so)."""
    return FORMATS[fmt].markers

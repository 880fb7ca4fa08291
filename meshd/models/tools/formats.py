"""Every tool-call format by name: how it is told from a chat template, how its calls
are read, the grammar that forces one, and the markers it needs shown.

The name travels on the wire (``DataChunk.tool_format``), from stage 0, which read
the template, to the API node, which reads the calls: names are kept as they are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .base import Reader, Tools
from .grammar import LarkMaker
from .hermes import HERMES_CLOSE, HERMES_OPEN, hermes_lark, hermes_reader
from .json_answer import json_answer_lark, json_answer_reader

__all__ = ["FORMATS", "Format", "ToolFormat", "tool_format"]

ToolFormat = Literal["hermes", "llama3", "mistral", "generic"]


@dataclass(frozen=True)
class Format:
    """One way of writing calls."""

    #: A reader of one answer, given the request's tools (some formats type the
    #: arguments with the functions' schemas).
    reader: Callable[[Tools], Reader]
    #: The grammar of one forced call.
    lark: LarkMaker
    #: Markers that may be control tokens of the model, which the answer must show
    #: as text for :attr:`reader` to see them (none for llama3 and mistral, whose
    #: readers expect their control tokens to show as nothing).
    markers: tuple[str, ...] = ()


FORMATS: dict[ToolFormat, Format] = {
    "hermes": Format(hermes_reader, hermes_lark, (HERMES_OPEN, HERMES_CLOSE)),
    "generic": Format(hermes_reader, hermes_lark),
    "llama3": Format(json_answer_reader, json_answer_lark("parameters", as_list=False)),
    "mistral": Format(json_answer_reader, json_answer_lark("arguments", as_list=True)),
}


def _has(*telltales: str) -> Callable[[str], bool]:
    return lambda template: all(t in template for t in telltales)


# Which format a template shows: the first whose telltales it holds.
_DETECT: tuple[tuple[Callable[[str], bool], ToolFormat], ...] = (
    (lambda template: "tools" not in template, "generic"),
    (_has("<tool_call>"), "hermes"),
    (_has("[TOOL_CALLS]"), "mistral"),
    (lambda template: "<|python_tag|>" in template or "ipython" in template, "llama3"),
)


def tool_format(template: str | None) -> ToolFormat:
    """The way the model of this chat template calls tools (``generic``: it knows none)."""
    if not template:
        return "generic"
    for matches, fmt in _DETECT:
        if matches(template):
            return fmt
    return "generic"

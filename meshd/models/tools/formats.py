"""Every tool-call format by name: how it is told from a chat template, how its calls
are read, the grammar that forces one, and the markers it needs shown.

The name travels on the wire (``DataChunk.tool_format``), from stage 0, which read
the template, to the API node, which reads the calls: names are kept as they are."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .base import Reader, Tools
from .command_r import COMMAND_R_MARKERS, command_r_lark, command_r_reader
from .deepseek import DEEPSEEK_MARKERS, deepseek_lark, deepseek_reader
from .glm import GLM_MARKERS, glm_lark, glm_reader
from .grammar import LarkMaker
from .granite import GRANITE_CALL, granite_lark, granite_reader
from .harmony import HARMONY_MARKERS, harmony_lark, harmony_reader
from .hermes import HERMES_CLOSE, HERMES_OPEN, hermes_lark, hermes_reader
from .json_answer import json_answer_lark, json_answer_reader
from .kimi import KIMI_MARKERS, kimi_history, kimi_lark, kimi_reader
from .pythonic import PYTHON_END, PYTHON_START, pythonic_lark, pythonic_reader
from .qwen_xml import qwen_xml_lark, qwen_xml_reader

__all__ = ["FORMATS", "Format", "ToolFormat", "tool_format"]

ToolFormat = Literal[
    "hermes",
    "llama3",
    "mistral",
    "generic",
    "qwen3_coder",
    "pythonic",
    "deepseek_r1",
    "deepseek_v31",
    "harmony",
    "granite",
    "kimi_k2",
    "glm45",
    "command_r",
    "command_r7b",
]


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
    #: The template concatenates a call's arguments as text (DeepSeek's): they stay
    #: the JSON string OpenAI carries, not a mapping.
    string_arguments: bool = False
    #: Earlier turns as the template wants them (call ids in the model's own shape).
    history: Callable[[Sequence[Mapping[str, Any]]], list[dict[str, Any]]] | None = None


FORMATS: dict[ToolFormat, Format] = {
    "hermes": Format(hermes_reader, hermes_lark, (HERMES_OPEN, HERMES_CLOSE)),
    "generic": Format(hermes_reader, hermes_lark),
    "llama3": Format(json_answer_reader, json_answer_lark("parameters", as_list=False)),
    "mistral": Format(json_answer_reader, json_answer_lark("arguments", as_list=True)),
    "qwen3_coder": Format(qwen_xml_reader, qwen_xml_lark, (HERMES_OPEN, HERMES_CLOSE)),
    "glm45": Format(glm_reader, glm_lark, GLM_MARKERS),
    "pythonic": Format(pythonic_reader, pythonic_lark, (PYTHON_START, PYTHON_END)),
    "deepseek_r1": Format(deepseek_reader, deepseek_lark(fenced=True), DEEPSEEK_MARKERS, True),
    "deepseek_v31": Format(deepseek_reader, deepseek_lark(fenced=False), DEEPSEEK_MARKERS, True),
    "harmony": Format(harmony_reader, harmony_lark, HARMONY_MARKERS),
    "granite": Format(granite_reader, granite_lark, (GRANITE_CALL,)),
    "kimi_k2": Format(kimi_reader, kimi_lark, KIMI_MARKERS, history=kimi_history),
    "command_r": Format(command_r_reader, command_r_lark(r7b=False)),
    "command_r7b": Format(command_r_reader, command_r_lark(r7b=True), COMMAND_R_MARKERS),
}

# Llama 4's (and Llama 3.2's pythonic) prompt shows the call syntax itself.
_PYTHONIC = re.compile(r"\[\s*func_name\d*\(")


def _has(*telltales: str) -> Callable[[str], bool]:
    return lambda template: all(t in template for t in telltales)


# Which format a template shows: the first whose telltales it holds. The formats
# meshd knew first come after the "tools" check, in their old order, so a template
# they matched still does; the others' telltales are their own (the templates of
# Qwen3-Coder and GLM-4.5 hold "<tool_call>" too, so they come before Hermes).
_DETECT: tuple[tuple[Callable[[str], bool], ToolFormat], ...] = (
    (_has("<|channel|>"), "harmony"),
    (_has("<｜tool▁calls▁begin｜>", "```json"), "deepseek_r1"),
    (_has("<｜tool▁calls▁begin｜>"), "deepseek_v31"),
    (_has("<|tool_calls_section_begin|>", "<|tool_call_begin|>"), "kimi_k2"),
    (_has("<|START_ACTION|>"), "command_r7b"),
    (_has("Action:", "tool_name"), "command_r"),
    (_has("<|tool_call|>"), "granite"),
    (_has("<arg_key>", "<tool_call>"), "glm45"),
    (_has("<function=", "<parameter="), "qwen3_coder"),
    (lambda template: "tools" not in template, "generic"),
    (_has("<tool_call>"), "hermes"),
    (_has("[TOOL_CALLS]"), "mistral"),
    (lambda template: _PYTHONIC.search(template) is not None, "pythonic"),
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

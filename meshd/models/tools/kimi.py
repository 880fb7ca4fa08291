"""Kimi K2: a section of calls, each with an id ``functions.NAME:INDEX`` and its JSON
arguments, between the model's control tokens::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(without the line break). The template shows earlier calls with their ids and each
result as the return of its id, so ids in the history are given that shape too."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .base import BlockReader, Part, Tools, loads, named_call, section
from .grammar import Marks, json_rule, lit, parameters, picked

__all__ = ["KIMI_MARKERS", "kimi_history", "kimi_lark", "kimi_reader"]

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENTS = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
#: The markers, each a control token of Kimi's vocabulary.
KIMI_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENTS, CALL_END)
# Seen in the wild: the section markers in the singular.
_SINGULAR_BEGIN, _SINGULAR_END = "<|tool_call_section_begin|>", "<|tool_call_section_end|>"
_SECTIONS = (SECTION_BEGIN, SECTION_END, _SINGULAR_BEGIN, _SINGULAR_END)
_INDEX = re.compile(r":\d+\Z")


def _call(text: str, final: bool) -> tuple[int, list[Part]] | None:
    # A call ends at its end marker, or (the model strays) where the next one starts.
    ends = (text.find(m, len(CALL_BEGIN)) for m in (CALL_END, *_SECTIONS, CALL_BEGIN))
    found = [i for i in ends if i >= 0]
    if not found and not final:
        return None
    end = min(found) if found else len(text)
    n = end + len(CALL_END) if text.startswith(CALL_END, end) else end
    ident, sep, args = text[len(CALL_BEGIN) : end].partition(ARGUMENTS)
    name = _INDEX.sub("", ident.strip()).removeprefix("functions.")
    call = named_call(name, loads(args)) if sep else None
    return n, [call if call is not None else text[:n]]


def kimi_reader(tools: Tools) -> BlockReader:
    """A reader of Kimi K2's call sections."""
    plural = section(SECTION_BEGIN, SECTION_END, CALL_BEGIN, _call)
    singular = section(_SINGULAR_BEGIN, _SINGULAR_END, CALL_BEGIN, _call)

    def block(text: str, final: bool) -> tuple[int, list[Part]] | None:
        return (singular if text.startswith(_SINGULAR_BEGIN) else plural)(text, final)

    return BlockReader([SECTION_BEGIN, _SINGULAR_BEGIN, CALL_BEGIN], block)


def kimi_lark(tools: Tools, name: str | None, marks: Marks) -> str:
    """A section of one call, its id that of a first call."""
    calls, rules = [], []
    for i, t in enumerate(picked(tools, name)):
        ident = lit(f"functions.{t['name']}:0")
        rules.append(f"c{i}: {ident} {marks(ARGUMENTS)} {json_rule(parameters(t))}")
        calls.append(f"c{i}")
    head = f"start: {marks(SECTION_BEGIN)} {marks(CALL_BEGIN)} ({' | '.join(calls)})"
    return "\n".join([f"{head} {marks(CALL_END)} {marks(SECTION_END)}", *rules]) + "\n"


def kimi_history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each call's id as Kimi writes them (``functions.NAME:N``, N
    counting the conversation's calls) and each tool result naming its call so."""
    ids: dict[str, str] = {}
    out = []
    n = 0
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                new = f"functions.{c['function']['name']}:{n}"
                n += 1
                ids[c.get("id") or new] = new
                calls.append({**c, "id": new})
            m["tool_calls"] = calls
        elif m.get("role") == "tool" and m.get("tool_call_id") in ids:
            m["tool_call_id"] = ids[m["tool_call_id"]]
        out.append(m)
    return out

"""Cohere Command R / R+ and R7B: a JSON list of ``{"tool_name": ..., "parameters":
{...}}``, after ``Action:`` in a fenced block (R, R+) or between the control tokens
``<|START_ACTION|>`` and ``<|END_ACTION|>`` (R7B, whose items also carry a
``tool_call_id``). R+'s own ``directly-answer`` tool says "no call": it is dropped."""

from __future__ import annotations

import json
import re
from typing import Any

from .base import BlockReader, ParsedCall, Part, Tools, call_of
from .grammar import LarkMaker, Marks, json_rule, parameters, picked

__all__ = ["COMMAND_R_MARKERS", "command_r_lark", "command_r_reader"]

ACTION = "Action:"
START_ACTION = "<|START_ACTION|>"
END_ACTION = "<|END_ACTION|>"
#: R7B's markers, control tokens of its vocabulary.
COMMAND_R_MARKERS = (START_ACTION, END_ACTION)
_FENCE = "```"
_FENCE_OPEN = re.compile(r"\s*```(?:json)?\s*")
_NO_CALL = frozenset({"directly-answer", "directly_answer"})


def _calls(found: Any) -> list[ParsedCall] | None:
    items = found if isinstance(found, list) else [found]
    calls = [call_of(i, "tool_name", ("parameters",)) for i in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None and c.name not in _NO_CALL]


def _action(text: str, final: bool) -> tuple[int, list[Part]] | None:
    """``Action:`` and a fenced JSON list."""
    fence = _FENCE_OPEN.match(text, len(ACTION))
    if fence is None:
        if not final and _FENCE.startswith(text[len(ACTION) :].lstrip()):
            return None  # the fence may be on its way
        return len(ACTION), [ACTION]
    if fence.end() == len(text) and not final:
        return None
    try:
        found, end = json.JSONDecoder().raw_decode(text, fence.end())
    except ValueError:
        return (len(ACTION), [ACTION]) if final else None
    after = text[end:]
    rest = after.lstrip()
    if not final and len(rest) < len(_FENCE) and _FENCE.startswith(rest):
        return None  # the closing fence may be on its way
    if rest.startswith(_FENCE):
        end += len(after) - len(rest) + len(_FENCE)
    calls = _calls(found)
    return end, list(calls) if calls is not None else [text[:end]]


def _block(text: str, final: bool) -> tuple[int, list[Part]] | None:
    if text.startswith(ACTION):
        return _action(text, final)
    end = text.find(END_ACTION)
    if end < 0 and not final:
        return None
    n = len(text) if end < 0 else end + len(END_ACTION)
    try:
        calls = _calls(json.loads(text[len(START_ACTION) : end if end >= 0 else n]))
    except ValueError:
        calls = None
    return n, list(calls) if calls is not None else [text[:n]]


def command_r_reader(tools: Tools) -> BlockReader:
    """A reader of Command R's actions (both shapes)."""
    return BlockReader([ACTION, START_ACTION], _block)


def command_r_lark(r7b: bool) -> LarkMaker:
    """The grammar maker of a one-call action list: R7B's between its control tokens
    (with the first call's id), else R+'s after ``Action:``."""

    def lark(tools: Tools, name: str | None, marks: Marks) -> str:
        items = []
        for t in picked(tools, name):
            props: dict[str, Any] = {"tool_name": {"const": t["name"]}}
            if r7b:
                props = {"tool_call_id": {"const": "0"}, **props}
            props["parameters"] = parameters(t)
            items.append(
                {"type": "object", "properties": props, "required": list(props),
                 "additionalProperties": False}
            )  # fmt: skip
        item = items[0] if len(items) == 1 else {"anyOf": items}
        body = json_rule({"type": "array", "items": item, "minItems": 1, "maxItems": 1})
        if r7b:
            return f"start: {marks(START_ACTION)} {body} {marks(END_ACTION)}\n"
        return f'start: "Action: ```json\\n" {body} "\\n```"\n'

    return lark

"""IBM Granite 3.x: the ``<|tool_call|>`` control token, then a JSON list of
``{"name": ..., "arguments": {...}}`` (Granite 3.1 may write the text
``<tool_call>`` instead)."""

from __future__ import annotations

import json

from .base import BlockReader, Part, Tools, call_of
from .grammar import Marks, json_rule
from .hermes import HERMES_CLOSE, HERMES_OPEN, call_schema

__all__ = ["GRANITE_CALL", "granite_lark", "granite_reader"]

GRANITE_CALL = "<|tool_call|>"


def _block(text: str, final: bool) -> tuple[int, list[Part]] | None:
    opener = GRANITE_CALL if text.startswith(GRANITE_CALL) else HERMES_OPEN
    rest = text[len(opener) :]
    body = rest.lstrip()
    if not body:
        return (len(text), [text]) if final else None
    if body[0] not in "[{":
        return len(opener), [opener]
    start = len(text) - len(body)
    try:  # cheap to try: the list ends the answer, and so its text, most of the time
        found, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        if not final:
            return None
        return len(text), [text]
    items = found if isinstance(found, list) else [found]
    calls = [call_of(i) for i in items]
    if not calls or any(c is None for c in calls):
        return end, [text[:end]]
    closing = text[end:].lstrip()  # a Hermes-style closing tag, when there is one
    if closing.startswith(HERMES_CLOSE):
        end = len(text) - len(closing) + len(HERMES_CLOSE)
    return end, [c for c in calls if c is not None]


def granite_reader(tools: Tools) -> BlockReader:
    """A reader of Granite's call lists."""
    return BlockReader([GRANITE_CALL, HERMES_OPEN], _block)


def granite_lark(tools: Tools, name: str | None, marks: Marks) -> str:
    """The control token and a one-call list."""
    schema = {"type": "array", "items": call_schema(tools, name), "minItems": 1, "maxItems": 1}
    return f"start: {marks(GRANITE_CALL)} {json_rule(schema)}\n"

"""Hermes (Hermes 2/3, Qwen 2/2.5/3, SmolLM3, ...): one ``<tool_call>`` block per call,
``{"name": ..., "arguments": {...}}`` inside; also the syntax the generic tool prompt
teaches a model that knows no tools."""

from __future__ import annotations

from typing import Any

from .base import BlockReader, Part, Tools, call_of, loads
from .grammar import Marks, json_rule, parameters, picked

__all__ = ["HERMES_CLOSE", "HERMES_OPEN", "call_schema", "hermes_lark", "hermes_reader"]

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


def _block(text: str, final: bool) -> tuple[int, list[Part]] | None:
    end = text.find(HERMES_CLOSE)
    if end < 0:
        if not final:
            return None
        # A call cut short (the end token before its closing tag) still counts.
        call = call_of(loads(text[len(HERMES_OPEN) :]))
        return len(text), [call if call is not None else text]
    n = end + len(HERMES_CLOSE)
    call = call_of(loads(text[len(HERMES_OPEN) : end]))
    return n, [call if call is not None else text[:n]]


def hermes_reader(tools: Tools) -> BlockReader:
    """A reader of ``<tool_call>{json}</tool_call>`` blocks."""
    return BlockReader([HERMES_OPEN], _block)


def call_schema(tools: Tools, name: str | None, key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one ``{"name": ..., key: {...}}`` call of ``name`` (None:
    any of ``tools``), its arguments valid under the function's schema."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, key: parameters(t)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in picked(tools, name)
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def hermes_lark(tools: Tools, name: str | None, marks: Marks) -> str:
    """One ``<tool_call>`` block: the tags around the call's JSON on lines of their own."""
    return (
        f'start: {marks(HERMES_OPEN)} "\\n" call "\\n" {marks(HERMES_CLOSE)}\n'
        f"call: {json_rule(call_schema(tools, name))}\n"
    )

"""Pieces of the grammars that force a call (``tool_choice`` ``required`` or a named
function), in llguidance's Lark dialect: markers as text or as the model's own
control token, JSON under a schema, a raw value, and a run of optional items.

A marker the model's vocabulary holds as a control token (gpt-oss's
``<|channel|>``, Granite's ``<|tool_call|>``) is written as that token
(``<[id]>``): one token, as the model writes it; spelt out as text it would cost
several, and read as text the model never wrote. Stage 0 knows the ids
(:func:`control_tokens`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .base import Tools

__all__ = [
    "NO_ARGUMENTS",
    "LarkMaker",
    "Marks",
    "control_tokens",
    "json_rule",
    "lit",
    "parameters",
    "picked",
    "sequence",
]

#: The schema of a function that declares no parameters (as OpenAI reads it).
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

#: How forced JSON is laid out: as :data:`meshd.engines.grammar.JSON_STYLE` (the
#: separators most JSON in training data uses; no free whitespace to pad with).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


#: A format's forced-call grammar: ``(tools, name, marks) -> Lark``, one call of
#: ``name`` (None: any of ``tools``) in the format, its markers written by ``marks``.
LarkMaker = Callable[[Tools, "str | None", "Marks"], str]


def lit(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: Mapping[str, Any]) -> str:
    """A Lark expression for JSON text valid under ``schema``, laid out compactly."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE}, ensure_ascii=False)


def picked(tools: Tools, name: str | None) -> list[Mapping[str, Any]]:
    """The tools a forced call may call: the one named ``name``, or all (None)."""
    return [t for t in tools if name is None or t.get("name") == name]


def parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of ``tool``'s arguments (none declared: it takes none)."""
    return dict(tool.get("parameters") or NO_ARGUMENTS)


def sequence(items: Sequence[tuple[str, bool]], sep: str, prefix: str) -> tuple[str, list[str]]:
    """A Lark expression for ``items`` (each ``(expression, required)``) in order,
    each optional one present or not, ``sep`` (a literal, may be "") between those
    present; and the rules it uses, named from ``prefix``. Without a separator the
    items simply follow each other; with one, ``first{i}`` is the run from item
    ``i`` whose first present item comes with no separator before it."""
    if not items:
        return "", []
    if not sep:
        return " ".join(e if req else f"({e})?" for e, req in items), []
    rules = []
    # rest{i}: items i.. after one already present: each present one after sep.
    for i, (e, req) in enumerate(items):
        tail = f" rest{prefix}{i + 1}" if i + 1 < len(items) else ""
        body = f"{lit(sep)} {e}" if req else f"({lit(sep)} {e})?"
        rules.append(f"rest{prefix}{i}: {body}{tail}")
    # first{i}: items i.., none present yet (non-empty unless every one is optional).
    for i, (e, req) in enumerate(items):
        tail = f" rest{prefix}{i + 1}" if i + 1 < len(items) else ""
        skip = f" | first{prefix}{i + 1}" if not req and i + 1 < len(items) else ""
        rules.append(f"first{prefix}{i}: {e}{tail}{skip}")
    whole = f"first{prefix}0"
    return (whole if any(req for _, req in items) else f"({whole})?"), rules


class Marks:
    """Writes a format's markers into a grammar: as the control token where the
    model's vocabulary has one (``specials``: marker text -> token id), else as text."""

    def __init__(self, specials: Mapping[str, int] | None) -> None:
        self._specials = dict(specials or {})

    def __call__(self, text: str) -> str:
        """``text`` as a Lark item: its control token, or the literal."""
        token = self._specials.get(text)
        return f"<[{token}]>" if token is not None else lit(text)

    def special(self, text: str) -> bool:
        """Whether ``text`` is one control token of the model."""
        return text in self._specials


def control_tokens(
    texts: Iterable[str],
    tokenize: Callable[[str], Sequence[int]],
    piece: Callable[[int, bool], bytes],
) -> dict[str, int]:
    """Which of ``texts`` (a format's markers) are one control token of a model, and
    its id: ``tokenize`` parses special tokens; ``piece(id, special)`` renders a
    token, its text only when ``special`` for a control token."""
    found: dict[str, int] = {}
    for text in texts:
        ids = list(tokenize(text))
        if len(ids) != 1:
            continue
        shown = piece(ids[0], True)
        if shown == text.encode("utf-8") and not piece(ids[0], False):
            found[text] = ids[0]
    return found

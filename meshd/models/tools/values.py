"""Arguments written as raw text, one value per parameter (Qwen3-Coder's
``<parameter=p>``, GLM-4.5's ``<arg_value>``): read back with the function's JSON
schema, and forced with a grammar of the same shape.

Such a template writes a string as it is and anything else as JSON (``3``, ``true``,
``{"a": 1}``), so a value is read as JSON where the schema says it is no string; a
parameter the schema does not know stays a string, as does a value that is not the
JSON its schema wants (the client's own validation then says what is wrong)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .base import Tools
from .grammar import Marks, json_rule, lit, parameters, sequence

__all__ = ["properties_of", "raw_arguments_lark", "typed_value"]

# A free parameter name, for a function whose schema lists none.
_NAME = r"/[A-Za-z_][A-Za-z0-9_.\-]{0,63}/"
# Longest raw string value a forced call may write when the schema bounds none
# (admission bounds every string first; this is the fallback).
_MAX_STRING = 256


def properties_of(tools: Tools, name: str) -> dict[str, Any] | None:
    """The ``properties`` of the function ``name`` among ``tools`` (None: unknown)."""
    for t in tools:
        if t.get("name") == name:
            props = (t.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else None
    return None


def _types(schema: Any) -> set[str]:
    """The JSON types ``schema`` allows (empty: it does not say)."""
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    found: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            found |= _types(sub)
    for value in schema.get("enum") or ([schema["const"]] if "const" in schema else []):
        found.add("string" if isinstance(value, str) else "json")
    return found


def typed_value(raw: str, schema: Any) -> Any:
    """The value a raw argument text stands for under its parameter's ``schema``."""
    kinds = _types(schema)
    if not kinds or ("string" in kinds and not (raw.strip() == "null" and "null" in kinds)):
        return raw
    try:
        return json.loads(raw.strip())
    except ValueError:
        return raw  # not the JSON the schema wants: kept as written


def _string_value(schema: Mapping[str, Any], close: str, marks: Marks, rule: str) -> list[str]:
    """Rules for a raw string value named ``rule``, up to and with ``close``."""
    options = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    if options and all(isinstance(o, str) for o in options):
        return [f"{rule}: ({' | '.join(lit(o) for o in options)}) {marks(close)}"]
    bound = schema.get("maxLength", _MAX_STRING)
    low = min(schema.get("minLength", 0), bound)
    text = f"(?s:.{{{low},{bound}}})"
    if marks.special(close):
        # The closing control token ends the text: it cannot be inside a lexeme.
        return [f"{rule}: /{text}/ {marks(close)}"]
    # A lazy lexeme ends at the first closing text, so the value never holds it.
    pattern = "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in close)
    return [f"{rule}[lazy]: /{text}{pattern}/"]


def raw_arguments_lark(
    tool: Mapping[str, Any],
    item: tuple[str, str, str, str],
    marks: Marks,
    prefix: str,
) -> tuple[str, list[str]]:
    """A Lark expression for ``tool``'s arguments written as raw values, and the rules
    it uses (named from ``prefix``). ``item`` is how one argument is written: Lark
    before its name and before its value, the marker that closes the value, Lark
    after it.

    Declared parameters come in the schema's order, every required one, each other
    one or not; a string is free text up to its bound (an ``enum`` one of its
    values), anything else JSON under its schema. A function that declares none
    takes any names with string values."""
    before_name, before_value, close, after = item
    schema = parameters(tool)
    props = schema.get("properties")
    rules: list[str] = []

    def one(pname: str, value: str) -> str:
        return f"{before_name} {pname} {before_value} {value} {after}".rstrip()

    if not isinstance(props, dict):
        value = f"v{prefix}any"
        rules += _string_value({}, close, marks, value)
        return f"({one(_NAME, value)})*", rules
    required = set(schema.get("required") or ())
    items = []
    for i, (pname, pschema) in enumerate(props.items()):
        value = f"v{prefix}{i}"
        if isinstance(pschema, Mapping) and _types(pschema) <= {"string"}:
            rules += _string_value(pschema, close, marks, value)
        else:
            rules.append(f"{value}: {json_rule(dict(pschema or {}))} {marks(close)}")
        items.append((one(lit(pname), value), pname in required))
    expr, seq_rules = sequence(items, "", prefix)
    return expr, rules + seq_rules

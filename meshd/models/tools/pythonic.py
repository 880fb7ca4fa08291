"""Pythonic calls (Llama 4, Llama 3.2 with a pythonic prompt): a Python list of calls
with keyword arguments, ``[get_weather(city="Paris", days=3), other(x=[1, 2])]``,
sometimes between ``<|python_start|>`` and ``<|python_end|>``.

The list is parsed with :mod:`ast` and only literals are taken (a value is read as
JSON where it is JSON, so ``true`` and ``null`` work, else as a Python literal);
nothing is ever evaluated. A ``[`` that cannot open a call (``[1]``, ``[a link]``)
is shown at once."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from .base import BlockReader, ParsedCall, Part, Tools, named_call
from .grammar import Marks, json_rule, lit, parameters, picked, sequence

__all__ = ["PYTHON_END", "PYTHON_START", "parse_calls", "pythonic_lark", "pythonic_reader"]

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
# The start of a list of calls: "[" and a (dotted) function name and "(".
_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_HEAD_SO_FAR = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")


def _value(node: ast.expr, source: str) -> Any:
    segment = ast.get_source_segment(source, node) or ""
    try:
        return json.loads(segment)
    except ValueError:
        return ast.literal_eval(node)  # literals only: raises ValueError on anything else


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        outer = _name(node.value)
        return f"{outer}.{node.attr}" if outer else None
    return None


def parse_calls(source: str) -> list[ParsedCall] | None:
    """The calls a Python list of calls (or one call) holds, or None if ``source`` is
    not one (or holds anything but literals)."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls: list[ParsedCall] = []
        for node in nodes:
            if not isinstance(node, ast.Call) or node.args:
                return None
            args = {k.arg: _value(k.value, source.strip()) for k in node.keywords}
            if None in args:  # **kwargs
                return None
            call = named_call(_name(node.func), json.dumps(args, ensure_ascii=False))
            if call is None:
                return None
            calls.append(call)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return calls or None


def _block(text: str, final: bool) -> tuple[int, list[Part]] | None:
    if text.startswith(PYTHON_START):
        end = text.find(PYTHON_END)
        if end < 0 and not final:
            return None
        n = len(text) if end < 0 else end + len(PYTHON_END)
        calls = parse_calls(text[len(PYTHON_START) : end if end >= 0 else n])
        return n, list(calls) if calls is not None else [text[:n]]
    if not _HEAD.match(text):
        if _HEAD_SO_FAR.match(text) and not final:
            return None  # may still become a call
        return 1, ["["]
    # The list ends at one of its "]": the first at which it parses.
    end = text.find("]")
    while end >= 0:
        calls = parse_calls(text[: end + 1])
        if calls is not None:
            return end + 1, list(calls)
        end = text.find("]", end + 1)
    return (1, ["["]) if final else None


def pythonic_reader(tools: Tools) -> BlockReader:
    """A reader of pythonic call lists."""
    return BlockReader([PYTHON_START, "["], _block)


def pythonic_lark(tools: Tools, name: str | None, marks: Marks) -> str:
    """A one-call list, its arguments as keywords with JSON values (which Python
    reads as literals, and the reader as JSON)."""
    calls, rules = [], []
    for i, t in enumerate(picked(tools, name)):
        schema = parameters(t)
        required = set(schema.get("required") or ())
        items = [
            (f"{lit(p + '=')} {json_rule(s if isinstance(s, dict) else {})}", p in required)
            for p, s in (schema.get("properties") or {}).items()
        ]
        args, more = sequence(items, ", ", f"c{i}x")
        rules += [f'c{i}: {lit(t["name"] + "(")} {args} ")"', *more]
        calls.append(f"c{i}")
    return "\n".join([f'start: "[" ({" | ".join(calls)}) "]"', *rules]) + "\n"

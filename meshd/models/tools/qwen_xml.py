"""Qwen3-Coder (and later Qwen models that write calls as XML): a ``<tool_call>``
block holding ``<function=NAME>``, one ``<parameter=P>`` per argument with its value
on the lines between, raw (see :mod:`.values`)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Read leniently, as the models stray: a ``<function=`` block without its
``<tool_call>``, a parameter whose closing tag is missing, a function whose body is
JSON arguments; but a function must be closed (one cut short may hold a value cut
short: it is given back as text)."""

from __future__ import annotations

import json
import re

from .base import BlockReader, ParsedCall, Part, Tools, call_of, loads, named_call
from .grammar import Marks, lit, picked
from .hermes import HERMES_CLOSE, HERMES_OPEN
from .values import properties_of, raw_arguments_lark, typed_value

__all__ = ["qwen_xml_lark", "qwen_xml_reader"]

_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_FUNCTIONS = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
# One leading and one trailing newline belong to the layout, not to the value.
_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL
)


def _function(name: str, body: str, tools: Tools) -> ParsedCall | None:
    if _PARAMETER.search(body) is None and body.strip().startswith("{"):
        return named_call(name, loads(body))
    props = properties_of(tools, name.strip()) or {}
    args = {p.strip(): typed_value(v, props.get(p.strip())) for p, v in _PARAMETER.findall(body)}
    return named_call(name, json.dumps(args))


def _calls(inner: str, tools: Tools) -> list[ParsedCall] | None:
    if _FUNCTION not in inner:  # a Hermes JSON call in the block
        call = call_of(loads(inner))
        return [call] if call is not None else None
    found = [_function(n, b, tools) for n, b in _FUNCTIONS.findall(inner)]
    # A function left open was cut short: its last value may be too, so no call.
    if inner.count(_FUNCTION) != len(found) or any(c is None for c in found):
        return None
    return [c for c in found if c is not None]


def qwen_xml_reader(tools: Tools) -> BlockReader:
    """A reader of Qwen3-Coder's XML calls; ``tools`` types the raw values."""

    def block(text: str, final: bool) -> tuple[int, list[Part]] | None:
        closer = HERMES_CLOSE if text.startswith(HERMES_OPEN) else _FUNCTION_END
        end = text.find(closer)
        if end < 0 and not final:
            return None
        n = len(text) if end < 0 else end + len(closer)
        # A bare <function=...> block is read with its tags, as inside a <tool_call>.
        inner = text[:n].removeprefix(HERMES_OPEN).removesuffix(HERMES_CLOSE)
        calls = _calls(inner, tools)
        return n, list(calls) if calls is not None else [text[:n]]

    return BlockReader([HERMES_OPEN, _FUNCTION], block)


def qwen_xml_lark(tools: Tools, name: str | None, marks: Marks) -> str:
    """One ``<tool_call>`` block with one ``<function=...>`` as the template lays it out."""
    item = ('"<parameter="', '">\\n"', "\n</parameter>\n", "")
    calls, rules = [], []
    for i, t in enumerate(picked(tools, name)):
        args, more = raw_arguments_lark(t, item, marks, f"c{i}x")
        rules += [f'c{i}: "<function=" {lit(t["name"])} ">\\n" {args}'.rstrip(), *more]
        calls.append(f"c{i}")
    head = f'start: {marks(HERMES_OPEN)} "\\n" ({" | ".join(calls)})'
    return "\n".join([f'{head} "</function>\\n" {marks(HERMES_CLOSE)}', *rules]) + "\n"

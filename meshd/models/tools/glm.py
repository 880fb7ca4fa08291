"""GLM-4.5 / 4.6: a ``<tool_call>`` block with the function's name on its first line,
then each argument as a key and a raw value (see :mod:`.values`)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>
"""

from __future__ import annotations

import json
import re

from .base import BlockReader, ParsedCall, Part, Tools, call_of, loads, named_call
from .grammar import Marks, lit, picked
from .hermes import HERMES_CLOSE, HERMES_OPEN
from .values import properties_of, raw_arguments_lark, typed_value

__all__ = ["GLM_MARKERS", "glm_lark", "glm_reader"]

_KEY, _KEY_END = "<arg_key>", "</arg_key>"
_VALUE, _VALUE_END = "<arg_value>", "</arg_value>"
#: The markers a GLM vocabulary may hold as tokens of their own.
GLM_MARKERS = (HERMES_OPEN, HERMES_CLOSE, _KEY, _KEY_END, _VALUE, _VALUE_END)
_ARGUMENT = re.compile(
    r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|(?=<arg_key>))", re.DOTALL
)
_NAME = re.compile(r"[\w.\-]+")


def _call(inner: str, tools: Tools) -> ParsedCall | None:
    head, _, _ = inner.partition(_KEY)
    name = head.strip()
    if name.startswith("{"):  # a Hermes JSON call in the block
        return call_of(loads(inner))
    if not _NAME.fullmatch(name):
        return None
    pairs = _ARGUMENT.findall(inner)
    if len(pairs) != inner.count(_KEY):  # a value cut short: no call
        return None
    props = properties_of(tools, name) or {}
    args = {k.strip(): typed_value(v, props.get(k.strip())) for k, v in pairs}
    return named_call(name, json.dumps(args))


def glm_reader(tools: Tools) -> BlockReader:
    """A reader of GLM-4.5's calls; ``tools`` types the raw values."""

    def block(text: str, final: bool) -> tuple[int, list[Part]] | None:
        end = text.find(HERMES_CLOSE)
        if end < 0 and not final:
            return None
        n = len(text) if end < 0 else end + len(HERMES_CLOSE)
        call = _call(text[len(HERMES_OPEN) : end if end >= 0 else n], tools)
        return n, [call if call is not None else text[:n]]

    return BlockReader([HERMES_OPEN], block)


def glm_lark(tools: Tools, name: str | None, marks: Marks) -> str:
    """One ``<tool_call>`` block, each argument on lines of its own."""
    item = (marks(_KEY), f'{marks(_KEY_END)} "\\n" {marks(_VALUE)}', _VALUE_END, '"\\n"')
    calls, rules = [], []
    for i, t in enumerate(picked(tools, name)):
        args, more = raw_arguments_lark(t, item, marks, f"c{i}x")
        rules += [f'c{i}: {lit(t["name"])} "\\n" {args}'.rstrip(), *more]
        calls.append(f"c{i}")
    head = f"start: {marks(HERMES_OPEN)} ({' | '.join(calls)}) {marks(HERMES_CLOSE)}"
    return "\n".join([head, *rules]) + "\n"

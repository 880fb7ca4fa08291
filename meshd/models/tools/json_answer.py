"""Formats whose whole answer is the calls' JSON:

* ``llama3`` (Llama 3.1+): ``{"name": ..., "parameters": {...}}`` (after a
  ``<|python_tag|>`` control token, which renders as nothing), several split by ``;``;
* ``mistral``: ``[TOOL_CALLS]`` (a control token, so nothing in the text) and a JSON
  list of ``{"name": ..., "arguments": {...}}``.

An answer that starts with ``{`` or ``[`` is read whole at its end (its text cannot be
shown before it is known not to be a call); any other streams as text, ``<tool_call>``
blocks in it read as Hermes ones (as a model may write when it strays)."""

from __future__ import annotations

import json

from .base import ParsedCall, Part, Tools, call_of
from .grammar import LarkMaker, Marks, json_rule
from .hermes import call_schema, hermes_reader

__all__ = ["JsonAnswerReader", "json_answer_lark", "json_answer_reader"]


def _calls_of_json(text: str) -> list[ParsedCall] | None:
    """Calls from a whole JSON answer (one object, several split by ``;``, or a list),
    or None if it is not one."""
    text = text.strip()
    try:
        found = json.loads(text)
        items = found if isinstance(found, list) else [found]
    except ValueError:
        try:
            items = [json.loads(part) for part in text.split(";")]
        except ValueError:
            return None
    calls = [call_of(i) for i in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


class JsonAnswerReader:
    """Reads an answer that is either text or, whole, the calls' JSON."""

    def __init__(self) -> None:
        self._held = ""
        self._started = False  # whether any non-space text came yet
        self._json_answer = False
        self._text = hermes_reader(())

    def feed(self, text: str) -> list[Part]:
        """What of the output so far can be shown after ``text``."""
        self._held += text
        if not self._started:
            head = self._held.lstrip()
            if not head:
                return []
            self._started = True
            self._json_answer = head[0] in "{["
        if self._json_answer:
            return []  # read whole at the end
        text, self._held = self._held, ""
        return self._text.feed(text)

    def finish(self) -> list[Part]:
        """Everything still held, once the output has ended."""
        if not self._json_answer:
            return self._text.feed(self._held) + self._text.finish()
        text, self._held = self._held, ""
        calls = _calls_of_json(text)
        return list(calls) if calls is not None else [text]


def json_answer_reader(tools: Tools) -> JsonAnswerReader:
    """A reader of a whole-JSON answer (``llama3``, ``mistral``)."""
    return JsonAnswerReader()


def json_answer_lark(key: str, as_list: bool) -> LarkMaker:
    """The grammar maker of a whole-JSON answer: each call's arguments under ``key``,
    the call in a one-item list when ``as_list``."""

    def lark(tools: Tools, name: str | None, marks: Marks) -> str:
        schema = call_schema(tools, name, key)
        if as_list:
            schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
        return f"start: {json_rule(schema)}\n"

    return lark

"""gpt-oss's harmony format: the answer is a run of messages, each a header, then
``<|message|>``, its body, and an end token::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

(without the line breaks; the prompt ends with ``<|start|>assistant``, so the first
header has none). A message to ``functions.NAME`` (named in the channel's header or
before ``<|channel|>``) is a call. A ``final`` or ``commentary`` message is text,
shown without its markup as it streams. An ``analysis`` message is reasoning: it is
passed on whole, markup and all, for whoever reads reasoning; it is never a call."""

from __future__ import annotations

import re
from typing import Literal

from .base import Part, Tools, emit, loads, named_call, partial_suffix
from .grammar import Marks, json_rule, lit, parameters, picked

__all__ = ["HARMONY_MARKERS", "HarmonyReader", "harmony_lark", "harmony_reader"]

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
CONSTRAIN, END, CALL, RETURN = "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"
#: The markers, control tokens of gpt-oss's vocabulary (``<|call|>`` and
#: ``<|return|>`` end the answer, so they seldom reach the text).
HARMONY_MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_RECIPIENT = " to=functions."
_HEADERS = (START, CHANNEL, _RECIPIENT)
_ENDS = (END, CALL, RETURN)
_TO = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
# A header longer than this is no header: it is shown as text.
_MAX_HEADER = 512


class HarmonyReader:
    """Reads harmony messages as they stream (see the module's text)."""

    def __init__(self) -> None:
        self._held = ""
        #: Inside a body: None (outside any), "text", "analysis", or "call".
        self._body: Literal["text", "analysis", "call"] | None = None
        self._name = ""  # the function a call's body is for
        self._header = ""  # a call's header, given back with its body if no call

    def feed(self, text: str) -> list[Part]:
        """What of the output so far can be shown after ``text``."""
        self._held += text
        return self._scan(final=False)

    def finish(self) -> list[Part]:
        """Everything still held, once the output has ended."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while self._held or (self._body is not None and final):
            read = self._outside if self._body is None else self._inside
            if not read(out, final):
                break
        return out

    def _outside(self, out: list[Part], final: bool) -> bool:
        """Text up to a header, then the header read; False: wait for more."""
        starts = [i for i in (self._held.find(h) for h in _HEADERS) if i >= 0]
        if not starts:
            keep = 0 if final else partial_suffix(self._held, _HEADERS)
            emit(out, self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            return False
        start = min(starts)
        emit(out, self._held[:start])
        self._held = self._held[start:]
        end = self._held.find(MESSAGE)
        if end < 0 or end > _MAX_HEADER:
            if end < 0 and not final and len(self._held) <= _MAX_HEADER:
                return False
            emit(out, self._held[0])  # no header after all: shown, and read on
            self._held = self._held[1:]
            return True
        header, self._held = self._held[: end + len(MESSAGE)], self._held[end + len(MESSAGE) :]
        to, channel = _TO.search(header), _CHANNEL.search(header)
        if to is not None:
            self._body, self._name, self._header = "call", to.group(1), header
        elif channel is not None and channel.group(1) == "analysis":
            self._body = "analysis"
            emit(out, header[header.find(CHANNEL) :])
        else:
            self._body = "text"
        return True

    def _inside(self, out: list[Part], final: bool) -> bool:
        """A body up to its end; False: wait for more."""
        stops = [i for i in (self._held.find(m) for m in (*_ENDS, START, CHANNEL)) if i >= 0]
        stop = min(stops) if stops else -1
        body = self._body
        if body in ("text", "analysis"):
            if stop < 0:
                keep = 0 if final else partial_suffix(self._held, (*_ENDS, START, CHANNEL))
                emit(out, self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                if final:
                    self._body = None
                return False
            emit(out, self._held[:stop])
            self._held = self._held[stop:]
            if body == "analysis" and self._held.startswith(END):
                emit(out, END)
        else:  # a call: its arguments come whole
            if stop < 0 and not final:
                return False
            args = self._held if stop < 0 else self._held[:stop]
            self._held = self._held[len(args) :]
            call = named_call(self._name, loads(args))
            out.append(call if call is not None else self._header + args)
        self._body = None
        for end in _ENDS:  # the body's own end token is markup
            if self._held.startswith(end):
                self._held = self._held[len(end) :]
        return True


def harmony_reader(tools: Tools) -> HarmonyReader:
    """A reader of harmony messages."""
    return HarmonyReader()


def harmony_lark(tools: Tools, name: str | None, marks: Marks) -> str:
    """One commentary message to the function, its JSON arguments as constrained."""
    calls, rules = [], []
    for i, t in enumerate(picked(tools, name)):
        rules.append(f'c{i}: {lit(t["name"] + " ")} {marks(CONSTRAIN)} "json"')
        calls.append(f"c{i}")
        rules.append(f"a{i}: {json_rule(parameters(t))}")
    alts = " | ".join(f"c{i} {marks(MESSAGE)} a{i}" for i in range(len(calls)))
    head = f'start: {marks(CHANNEL)} "commentary to=functions." ({alts})'
    return "\n".join([head, *rules]) + "\n"

"""Tool calls read back from an answer, for every dialect: a thin layer over
:class:`meshd.models.tools.ToolCallParser` that numbers the calls, gives them ids and
keeps one when the client asked for no parallel calls.

A call cut short by the token limit (``max_tokens``) is dropped: its arguments are not
whole, so no client could run it, and the markup it began with (``<tool_call>``, or the
JSON of a Llama 3 or Mistral call) is no text for the user. The answer ends by
``length`` as any cut answer does, each dialect saying so its own way. A call whose
arguments are whole, only its closing markup cut, is a call."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast, get_args

import msgspec

from meshd.models.tools import HERMES_CLOSE, HERMES_OPEN, ParsedCall, ToolCallParser, ToolFormat

__all__ = ["Call", "ChoiceCalls", "json_text", "new_call_id"]


def json_text(obj: object) -> str:
    """``obj`` as JSON text (the form OpenAI and the chat templates carry arguments in)."""
    return msgspec.json.encode(obj).decode()


def new_call_id() -> str:
    """A call id in OpenAI's style."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class Call:
    """One call the model made, in no dialect."""

    id: str
    name: str
    #: The arguments as JSON text (an object).
    arguments: str

    def arguments_object(self) -> dict[str, Any]:
        """The arguments as an object, for dialects that carry them so (Anthropic,
        Ollama); ``{}`` if the text is no JSON object (a call's grammar makes it one)."""
        try:
            args = msgspec.json.decode(self.arguments)
        except msgspec.DecodeError:
            return {}
        return args if isinstance(args, dict) else {}


class ChoiceCalls:
    """One choice's output split into content and calls, as it streams."""

    def __init__(
        self,
        fmt: str | None,
        *,
        parallel: bool = True,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        """``fmt``: the model's tool format (stage 0 says which); ``parallel`` False
        keeps only the first call; ``new_id`` names each call (the dialect's style)."""
        self._parser = ToolCallParser(cast(ToolFormat, fmt) if fmt in _FORMATS else "generic")
        self._parallel = parallel
        self._new_id = new_id
        #: The answer's first character that is not a space ("" until one came).
        self._head = ""
        #: Every call so far, in order.
        self.calls: list[Call] = []

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content and the calls that ``text`` lets through."""
        if not self._head:
            self._head = text.lstrip()[:1]
        return self._split(self._parser.feed(text))

    def finish(self, reason: str = "stop") -> tuple[str, list[Call]]:
        """The rest, once the answer has ended for ``reason`` (the runner's ``stop`` or
        ``length``: a call that ``length`` cut short is dropped, markup and all)."""
        parts = self._parser.finish()
        if reason == "length" and parts and isinstance(parts[-1], str):
            parts[-1:] = self._cut_call(parts[-1])
        return self._split(parts)

    def _cut_call(self, rest: str) -> list[str | ParsedCall]:
        """``rest`` (what the parser gave back as text at the end of an answer the
        token limit cut) up to the call the limit cut; that call too when only its
        closing markup was cut (its arguments are whole: it can run)."""
        fmt = self._parser.fmt
        if fmt in _JSON_ANSWER and self._head in ("{", "["):
            # The whole answer is held as JSON: one that did not parse and begins as a
            # call does is that call, cut (a Mistral list maybe only before its "]").
            if not _begins_call(rest):
                return [rest]
            return [p for p in _parsed(fmt, rest + "]") if not isinstance(p, str)]
        start = rest.rfind(HERMES_OPEN)
        if start >= 0 and HERMES_CLOSE not in rest[start:]:
            block = _without_partial(rest[start:].rstrip(), HERMES_CLOSE)
            calls = [p for p in _parsed(fmt, block + HERMES_CLOSE) if not isinstance(p, str)]
            return [rest[:start], *calls]
        # Cut inside the opening tag itself ("...<tool_c").
        return [_without_partial(rest, HERMES_OPEN)]

    def _split(self, parts: list[str | ParsedCall]) -> tuple[str, list[Call]]:
        text: list[str] = []
        new: list[Call] = []
        for p in parts:
            if isinstance(p, str):
                # Between and after calls the model writes newlines, not an answer.
                if not (self.calls and not p.strip()):
                    text.append(p)
            elif self._parallel or not self.calls:
                call = Call(id=self._new_id(), name=p.name, arguments=p.arguments)
                self.calls.append(call)
                new.append(call)
        return "".join(text), new


_FORMATS = frozenset(get_args(ToolFormat))
#: Formats whose calls are the whole answer, as JSON (see ``ToolCallParser``).
_JSON_ANSWER = frozenset({"llama3", "mistral"})


def _begins_call(text: str) -> bool:
    """Whether ``text`` is the start of a call written as JSON, as far as it came:
    ``{"name"`` (in a list, for Mistral), or a cut anywhere before its end (``{"na``)."""
    s = text.lstrip().removeprefix("[").lstrip()
    if not s.startswith("{"):
        return not s
    key = s[1:].lstrip()
    return key.startswith('"name"') or '"name"'.startswith(key)


def _parsed(fmt: ToolFormat, text: str) -> list[str | ParsedCall]:
    """``text`` read whole by a parser of its own: its calls, and text where none is."""
    parser = ToolCallParser(fmt)
    return parser.feed(text) + parser.finish()


def _without_partial(text: str, tag: str) -> str:
    """``text`` without a proper prefix of ``tag`` at its end (a tag the cut split)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast, get_args

import msgspec

from meshd.domain.chat import ToolSpec
from meshd.models.tools import ParsedCall, ToolCallParser, ToolFormat

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
        tools: Sequence[ToolSpec] = (),
    ) -> None:
        """``fmt``: the model's tool format (stage 0 says which); ``parallel`` False
        keeps only the first call; ``new_id`` names each call (the dialect's style);
        ``tools``: the functions offered, whose schemas type arguments that a format
        writes as raw text."""
        self._parser = ToolCallParser(
            cast(ToolFormat, fmt) if fmt in _FORMATS else "generic",
            [{"name": t.name, "parameters": t.parameters} for t in tools],
        )
        self._parallel = parallel
        self._new_id = new_id
        #: Every call so far, in order.
        self.calls: list[Call] = []

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content and the calls that ``text`` lets through."""
        return self._split(self._parser.feed(text))

    def finish(self, reason: str = "stop") -> tuple[str, list[Call]]:
        """The rest, once the answer has ended for ``reason`` (the runner's ``stop`` or
        ``length``: a call that ``length`` cut short is dropped, markup and all)."""
        return self._split(self._parser.finish(cut=reason == "length"))

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

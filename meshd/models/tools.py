"""Tool calls as models write them: which format a model uses, how a conversation with
tools is shown to it, how its calls are read back, and the grammar that forces one.

A model learns one way of calling a function, and its chat template shows it:

* ``hermes`` (Hermes, Qwen 2/2.5/3, SmolLM3, ...): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call;
* ``llama3`` (Llama 3.1+): the whole answer is ``{"name": ..., "parameters": {...}}``
  (after a ``<|python_tag|>`` control token, which renders as nothing);
* ``mistral``: ``[TOOL_CALLS]`` (a control token, so nothing in the text) and a JSON list
  of ``{"name": ..., "arguments": {...}}``;
* ``generic``: a template that knows no tools. The tools and the ``hermes`` syntax are
  explained in a system message (:func:`generic_tool_prompt`), earlier calls and tool
  results are shown in that syntax, so any model can call a tool.

:class:`ToolCallParser` reads any of them from text as it streams; every API dialect
uses it, so the rules are written once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "ParsedCall",
    "ToolCallParser",
    "ToolFormat",
    "forced_call_lark",
    "generic_tool_prompt",
    "template_messages",
    "tool_format",
]

ToolFormat = Literal["hermes", "llama3", "mistral", "generic"]

_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


def tool_format(template: str | None) -> ToolFormat:
    """The way the model of this chat template calls tools (``generic``: it knows none)."""
    if not template or "tools" not in template:
        return "generic"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "generic"


def generic_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that teaches a model without tool support to call ``tools``
    (each ``{"name", "description"?, "parameters"?}``)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call these functions (JSON Schema of each one's arguments):\n"
        f"{listed}\n\n"
        "To call a function, answer with only this, one block per call:\n"
        f'{HERMES_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
        f"{HERMES_CLOSE}\n"
        "A function's result comes back in <tool_response></tool_response>; then answer "
        "the user with it. If no function helps, answer the user directly."
    )


def _arguments(value: str) -> Any:
    # Templates (transformers' convention) expect a call's arguments as a mapping.
    try:
        return json.loads(value)
    except ValueError:
        return value


def template_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    fmt: ToolFormat,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` to render a conversation with tools through the chat
    template. Messages are OpenAI-shaped dicts (``tool_calls`` with ``function.arguments``
    as a JSON string, ``tool`` turns with ``tool_call_id``).

    A template with tool support gets the tools (as ``[{"type": "function", "function":
    ...}]``) and the turns as transformers passes them. A ``generic`` one gets no tools:
    a system message explains them, calls become ``<tool_call>`` text and results
    ``<tool_response>`` user text, consecutive user turns merged (templates that insist
    on alternating roles accept that).
    """
    if fmt != "generic":
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {**c, "function": {**c["function"],
                                       "arguments": _arguments(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ]  # fmt: skip
            out.append(m)
        return out, [{"type": "function", "function": dict(t)} for t in tools]
    shown: list[dict[str, Any]] = []
    # No tools (tool_choice "none" over a history with calls): no prompt to add.
    prompt = generic_tool_prompt(tools) if tools else ""
    if prompt and messages and messages[0].get("role") == "system":
        first = messages[0].get("content") or ""
        shown.append({"role": "system", "content": f"{first}\n\n{prompt}"})
        messages = messages[1:]
    elif prompt:
        shown.append({"role": "system", "content": prompt})
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                f"{HERMES_OPEN}\n"
                + json.dumps({"name": c["function"]["name"],
                              "arguments": _arguments(c["function"]["arguments"])},
                             ensure_ascii=False)
                + f"\n{HERMES_CLOSE}"
                for c in m["tool_calls"]
            ]  # fmt: skip
            content = "\n".join([content, *blocks] if content else blocks)
            shown.append({"role": "assistant", "content": content})
            continue
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if role == "user" and shown and shown[-1]["role"] == "user":
            shown[-1] = {"role": "user", "content": f"{shown[-1]['content']}\n\n{content}"}
        else:
            shown.append({"role": role, "content": content})
    return shown, None


def forced_call_lark(
    tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, name: str | None = None
) -> str:
    """A Lark grammar (llguidance's dialect) whose every sentence is one call, in the
    model's format, of ``name`` (None: any of ``tools``) with arguments valid under its
    schema (``tool_choice`` ``required`` or a named function)."""
    picked = [t for t in tools if name is None or t.get("name") == name]
    key = "parameters" if fmt == "llama3" else "arguments"
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                # No parameters: the function takes none (as OpenAI reads it).
                key: t.get("parameters") or _NO_ARGUMENTS,
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in picked
    ]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt == "mistral":
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    body = json.dumps({**schema, "x-guidance": options})
    if fmt in ("hermes", "generic"):
        return f'start: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"\ncall: %json {body}\n'
    return f"start: %json {body}\n"


@dataclass(frozen=True)
class ParsedCall:
    """One function call read from a model's output."""

    name: str
    #: The arguments as a JSON text (OpenAI's ``function.arguments``).
    arguments: str


def _call_of(obj: Any) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_of_json(text: str) -> list[ParsedCall] | None:
    """Calls from a whole JSON answer (llama3: one object or several split by ``;``;
    mistral: a list), or None if it is not one."""
    text = text.strip()
    try:
        found = json.loads(text)
        items = found if isinstance(found, list) else [found]
    except ValueError:
        try:
            items = [json.loads(part) for part in text.split(";")]
        except ValueError:
            return None
    calls = [_call_of(i) for i in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


class ToolCallParser:
    """Splits a model's output, as it streams, into text for the user and tool calls.

    :meth:`feed` takes each new piece of text and returns what can be shown now: strings
    (content) and :class:`ParsedCall` s, in order; text that may still turn out to be
    part of a call is held. :meth:`finish` returns the rest. A call that does not parse
    is given back as text, so nothing the model wrote is lost.
    """

    def __init__(self, fmt: ToolFormat) -> None:
        """``fmt``: the model's tool format (:func:`tool_format`)."""
        self.fmt = fmt
        self._held = ""
        self._started = False  # whether any non-space text came yet
        self._json_answer = False  # llama3 / mistral: the answer is one JSON text

    def feed(self, text: str) -> list[str | ParsedCall]:
        """What of the output so far can be shown after ``text``."""
        self._held += text
        if not self._started:
            head = self._held.lstrip()
            if not head:
                return []
            self._started = True
            if self.fmt in ("llama3", "mistral") and head[0] in "{[":
                self._json_answer = True
        if self._json_answer:
            return []  # read whole at the end: its text cannot be shown before
        return self._hermes(final=False)

    def finish(self) -> list[str | ParsedCall]:
        """Everything still held, once the output has ended."""
        if self._json_answer:
            text, self._held = self._held, ""
            calls = _calls_of_json(text)
            return list(calls) if calls is not None else [text]
        return self._hermes(final=True)

    def _hermes(self, final: bool) -> list[str | ParsedCall]:
        out: list[str | ParsedCall] = []
        while True:
            start = self._held.find(HERMES_OPEN)
            if start < 0:
                break
            end = self._held.find(HERMES_CLOSE, start)
            if end < 0:
                if final:  # a call cut short (EOS before its closing tag)
                    call = _call_of(_loads(self._held[start + len(HERMES_OPEN) :]))
                    if call is not None:
                        _emit(out, self._held[:start])
                        out.append(call)
                        self._held = ""
                break
            _emit(out, self._held[:start])
            block = self._held[start + len(HERMES_OPEN) : end]
            call = _call_of(_loads(block))
            out.append(call if call is not None else self._held[start : end + len(HERMES_CLOSE)])
            self._held = self._held[end + len(HERMES_CLOSE) :]
        if final:
            _emit(out, self._held)
            self._held = ""
            return out
        start = self._held.find(HERMES_OPEN)
        if start >= 0:  # inside a call: show what came before it
            _emit(out, self._held[:start])
            self._held = self._held[start:]
            return out
        keep = _partial_suffix(self._held, HERMES_OPEN)
        _emit(out, self._held[: len(self._held) - keep])
        self._held = self._held[len(self._held) - keep :]
        return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


def _emit(out: list[str | ParsedCall], text: str) -> None:
    if text:
        out.append(text)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

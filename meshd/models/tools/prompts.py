"""How a conversation with tools is shown to a model: through its chat template when
the template takes tools, else with the generic tool prompt (:func:`generic_tool_prompt`)
and earlier calls and results written out as text."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .formats import FORMATS, ToolFormat
from .hermes import HERMES_CLOSE, HERMES_OPEN

__all__ = ["generic_tool_prompt", "template_messages"]


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
    ...}]``) and the turns as transformers passes them (arguments as a mapping, except
    for templates that join them as text; call ids in the model's own shape where its
    template shows them). A ``generic`` one gets no tools:
    a system message explains them, calls become ``<tool_call>`` text and results
    ``<tool_response>`` user text, consecutive user turns merged (templates that insist
    on alternating roles accept that).
    """
    if fmt != "generic":
        family = FORMATS[fmt]
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls") and not family.string_arguments:
                m["tool_calls"] = [
                    {**c, "function": {**c["function"],
                                       "arguments": _arguments(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ]  # fmt: skip
            out.append(m)
        if family.history is not None:
            out = family.history(out)
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

"""Thinking on or off, and how much, with the model's own switch.

A template that reads a variable for it gets that variable: ``enable_thinking``
(Qwen3, GLM-4.5, SmolLM3, Hunyuan...) or ``thinking`` (DeepSeek V3.1, Granite 3.3);
gpt-oss's reads ``reasoning_effort`` (low, medium, high: the ``Reasoning:`` line of
its system message), and it cannot stop thinking: off is its lowest effort. A
template with no variable gets the family's soft switch in the last user turn where
the family has one (``/no_think`` for Qwen3's ChatML, ``/nothink`` for GLM); a prompt
that opens the thoughts itself (DeepSeek-R1's) is closed at once, with the model's
own close tag, as if the model had thought nothing. Otherwise the model thinks as it
will. Thinking is on unless a request turns it off (as llama-server's default)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .formats import TAGS, ReasoningFormat

__all__ = [
    "EFFORTS",
    "LOWEST_EFFORT",
    "Switch",
    "close_thoughts",
    "opens_thoughts",
    "soft_switched",
    "thinking_switch",
]

#: Variables of a template that turn thinking on and off, in the order they are tried.
_VARIABLES = ("enable_thinking", "thinking")
#: gpt-oss's efforts, and what a request that turns thinking off gets.
EFFORTS = ("low", "medium", "high")
LOWEST_EFFORT = "low"


@dataclass(frozen=True)
class Switch:
    """What a template offers to steer thinking."""

    #: The boolean variable that turns thinking on and off, if it reads one.
    variable: str | None = None
    #: The variable that sets how much it thinks (gpt-oss's ``reasoning_effort``).
    effort: str | None = None
    #: The text that turns thinking off from a user turn, where the family has one.
    soft_off: str | None = None


def thinking_switch(template: str | None, variables: Collection[str]) -> Switch:
    """The switch of ``template``, given the ``variables`` it reads
    (:func:`meshd.models.chat.template_variables`)."""
    if not template:
        return Switch()
    variable = next((v for v in _VARIABLES if v in variables), None)
    effort = "reasoning_effort" if "reasoning_effort" in variables else None
    soft = None
    if "/no_think" in template or ("<|im_start|>" in template and "<think>" in template):
        soft = "/no_think"
    elif "/nothink" in template or "[gMASK]" in template:
        soft = "/nothink"
    return Switch(variable, effort, soft)


def soft_switched(
    messages: Sequence[Mapping[str, Any]], switch: Switch
) -> list[Mapping[str, Any]] | None:
    """``messages`` with the soft switch that turns thinking off at the end of the
    last user turn, or None when the template has none (or no user turn)."""
    if switch.soft_off is None:
        return None
    out = list(messages)
    for i in range(len(out) - 1, -1, -1):
        m = out[i]
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            out[i] = {**m, "content": f"{m['content']} {switch.soft_off}".lstrip()}
            return out
    return None


def opens_thoughts(prompt: str, fmt: ReasoningFormat | None) -> bool:
    """Whether ``prompt`` (rendered) ends inside the thoughts: its template opened
    them in the generation prompt, so the output starts with thoughts."""
    if fmt is None or fmt == "harmony":
        return False
    tags = TAGS[fmt]
    tail = prompt.rstrip()
    return tail.endswith(tags.open)


def close_thoughts(prompt: str, fmt: ReasoningFormat) -> str:
    """``prompt``, which ends inside the thoughts, with them closed (empty), as the
    family's templates write a turn without thinking."""
    return f"{prompt.rstrip()}\n\n{TAGS[fmt].close}\n\n"

"""A conversation as every layer passes it on: chat turns flattened to text (an
image's place in it marked, its bytes beside), the functions a request offers and
how it wants them called."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["IMAGE_MARKER", "ChatTurn", "ToolCallTurn", "ToolSpec", "ToolUse", "image_text"]

#: Where an image of a turn goes in its text (U+E002, private use: no tokenizer gives it
#: a meaning). Stage 0 renders the chat template with it in place and puts the image's
#: rows there; a user's own U+E002 is dropped (:func:`image_text`), so only the API
#: node's markers remain, one per image, in order.
IMAGE_MARKER = "\ue002"


def image_text(text: str) -> str:
    """A user's text with any :data:`IMAGE_MARKER` removed (it is the API's to place)."""
    return text.replace(IMAGE_MARKER, "")


class ToolCallTurn(msgspec.Struct, frozen=True, array_like=True):
    """A function call an assistant turn made (OpenAI's ``tool_calls`` entry)."""

    id: str
    name: str
    #: The arguments as a JSON text.
    arguments: str


class ChatTurn(msgspec.Struct, frozen=True, array_like=True):
    """One chat message, already flattened to text."""

    role: str
    content: str
    #: An assistant turn's function calls.
    tool_calls: list[ToolCallTurn] = []
    #: A ``tool`` turn: the call it answers, and the function's name.
    tool_call_id: str | None = None
    name: str | None = None
    #: An assistant turn's thoughts, sent back by the client.
    reasoning: str | None = None
    #: The turn's images (the bytes of each file, PNG, JPEG...), in the order of the
    #: :data:`IMAGE_MARKER` in ``content`` that each stands for.
    images: list[bytes] = []

    def as_dict(self) -> dict[str, object]:
        """The turn as an OpenAI message (what chat templates are given)."""
        out: dict[str, object] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning:
            # Under both names templates read them by (Qwen3's reasoning_content,
            # gpt-oss's thinking); a template that reads neither drops past thoughts.
            out["reasoning_content"] = out["thinking"] = self.reasoning
        return out


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A function the model may call (OpenAI's ``tools[].function``)."""

    name: str
    description: str | None = None
    #: JSON Schema of its arguments.
    parameters: dict[str, Any] | None = None


class ToolUse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The functions a request offers, and whether the model must call one."""

    tools: list[ToolSpec]
    #: ``auto``, ``required`` (a call of any of ``tools``), or the name of the one
    #: function to call: stage 0 then constrains the output to one call.
    choice: str = "auto"

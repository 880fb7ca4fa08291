"""What several API test modules share: the tool schema they offer, and the chat
completions route's greedy answer that every other dialect must match."""

from __future__ import annotations

import httpx

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import NodeProc

#: The arguments of a ``get_weather`` function.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}


def greedy_chat(via: NodeProc, messages: list[dict], max_tokens: int) -> dict:
    """The chat completion of ``messages`` at temperature 0 (the reference answer)."""
    r = httpx.post(via.api + "/v1/chat/completions", timeout=120,
                   json={"model": DEFAULT_MODEL, "messages": messages, "temperature": 0,
                         "max_tokens": max_tokens})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()

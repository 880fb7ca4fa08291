"""Tools through the official `openai` client, on the default model split over two nodes
(its template knows no tools: the generic tool prompt teaches it)."""

from __future__ import annotations

import json

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.api.reference import WEATHER
from tests.cluster import NodeProc

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(300)

ADD = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
     "description": "The current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers",
     "parameters": ADD}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _chat(client, messages=QUESTION, **kw):
    return client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, tools=TOOLS, **kw)


def test_required_gives_a_valid_call_and_its_result_gives_a_final_answer(client) -> None:
    for seed in range(4):
        r = _chat(client, tool_choice="required", seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert set(args) <= set(SCHEMAS[call.function.name]["properties"])
    # Send the call and its result back: the model answers in text.
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18, "sky": "cloudy"}'},
    ]
    final = _chat(client, messages=history, tool_choice="none", seed=1, max_tokens=60)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")


def test_a_named_function_is_the_one_called(client) -> None:
    r = _chat(
        client,
        messages=[{"role": "user", "content": "What is 2 plus 40?"}],
        tool_choice={"type": "function", "function": {"name": "add"}},
        seed=3,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD)


def test_streamed_call_deltas_reassemble_to_the_same_call(client) -> None:
    whole = _chat(client, tool_choice="required", seed=7)
    (expected,) = whole.choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _chat(client, tool_choice="required", seed=7, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        for d in c.delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["name"] == expected.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(expected.function.arguments)
    assert calls[0]["id"].startswith("call_")


def test_auto_answers_in_text_or_a_call_and_never_both_garbled(client) -> None:
    r = _chat(client, tool_choice="auto", seed=2, max_tokens=80)
    m = r.choices[0].message
    if m.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        for call in m.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert m.content and "<tool_call>" not in m.content


@pytest.mark.parametrize(
    ("over", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f",
                     "parameters": {"type": "strin"}}}]}, "tools[0].function.parameters"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_them(via: NodeProc, over, param) -> None:
    body = {"model": DEFAULT_MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 8, **over}
    r = httpx.post(via.api + "/v1/chat/completions", json=body, timeout=30)
    if param is None:  # an empty tool_calls list on a user turn is harmless
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text

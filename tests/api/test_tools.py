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


def test_a_forced_call_cut_by_max_tokens_ends_by_length_with_no_markup(client, via) -> None:
    # 8 tokens end inside the call the grammar forces ("<tool_call>\n{"name": ...). One
    # tool, and no seed: every dialect's request has the same prompt, which the first
    # computes and the others read from the prefix cache.
    n, (tool,) = 8, TOOLS[:1]
    create = client.chat.completions.create
    r = create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=n, tools=[tool],
               tool_choice="required")  # fmt: skip
    assert r.choices[0].finish_reason == "length"
    assert not r.choices[0].message.tool_calls and not r.choices[0].message.content
    chunks = list(create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=n, tools=[tool],
                         tool_choice="required", stream=True))  # fmt: skip
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not any(c.choices[0].delta.content or c.choices[0].delta.tool_calls
                   for c in chunks if c.choices)  # fmt: skip

    resp = client.responses.create(
        model=DEFAULT_MODEL, input=QUESTION, max_output_tokens=n, tool_choice="required",
        tools=[{"type": "function", **tool["function"]}],
    )  # fmt: skip
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "" and all(i.type == "message" for i in resp.output)

    anthropic = pytest.importorskip("anthropic")
    ac = anthropic.Anthropic(base_url=via.api, api_key="unused", timeout=120, max_retries=0)
    f = tool["function"]
    m = ac.messages.create(
        model=DEFAULT_MODEL, max_tokens=n, messages=QUESTION, tool_choice={"type": "any"},
        tools=[{"name": f["name"], "description": f["description"], "input_schema": WEATHER}],
    )  # fmt: skip
    assert m.stop_reason == "max_tokens"
    assert [(b.type, b.text) for b in m.content] == [("text", "")]

    ollama = pytest.importorskip("ollama")
    body = {"model": DEFAULT_MODEL, "messages": QUESTION, "tools": [tool], "stream": False,
            "tool_choice": "required", "options": {"num_predict": n}}  # fmt: skip
    o = ollama.ChatResponse(**httpx.post(via.api + "/api/chat", json=body, timeout=120).json())
    assert o.done_reason == "length"
    assert o.message.content == "" and not o.message.tool_calls


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

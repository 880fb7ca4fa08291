"""OpenAI's Responses API (``POST /v1/responses``) through the official `openai` client,
on the default model split over two nodes, asked through a third that holds no stage:
the same runs as chat completions, in the Responses shapes."""

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

# Flat, as the Responses API takes them (chat completions nest them under "function").
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The current weather in a city",
     "parameters": WEATHER},
]  # fmt: skip
QUESTION = "What is the weather in Paris right now?"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _chat_text(client, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_a_string_input_with_instructions_answers_and_counts_as_chat_does(client) -> None:
    r = client.responses.create(
        model=DEFAULT_MODEL, instructions="You answer in one short sentence.",
        input="What colour is the sky?", max_output_tokens=20, temperature=0,
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and r.error is None
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert r.output_text and r.output_text == msg.content[0].text
    assert r.instructions == "You answer in one short sentence." and r.max_output_tokens == 20
    # The same conversation as chat messages: the same prompt, the same greedy answer.
    chat = _chat_text(
        client,
        [{"role": "system", "content": "You answer in one short sentence."},
         {"role": "user", "content": "What colour is the sky?"}],
        20,
    )  # fmt: skip
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0  # the package's instance is exact
    assert r.output_text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finish == "length" else "completed")
    # ``exact: false`` in the body: this one starts from the prompt the chat kept.
    warm = client.responses.create(
        model=DEFAULT_MODEL, instructions="You answer in one short sentence.",
        input="What colour is the sky?", max_output_tokens=4, temperature=0,
        extra_body={"exact": False},
    )  # fmt: skip
    assert 0 < warm.usage.input_tokens_details.cached_tokens < warm.usage.input_tokens


def test_greedy_items_input_gives_chat_completions_text(client) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Name another one."},
    ]
    items = [
        {"role": "system", "content": messages[0]["content"]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": messages[1]["content"]}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": messages[2]["content"]}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # skipped
        {"role": "user", "content": messages[3]["content"]},
    ]  # fmt: skip
    r = client.responses.create(
        model=DEFAULT_MODEL, input=items, max_output_tokens=12, temperature=0
    )
    chat = _chat_text(client, messages, 12)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_come_in_order_and_add_up_to_the_answer(client) -> None:
    kw = {"model": DEFAULT_MODEL, "input": "Say hello.", "max_output_tokens": 16,
          "temperature": 0}  # fmt: skip
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        evs = list(stream)
    types = [e.type for e in evs]
    last = types[-1]
    assert last == ("response.completed" if whole.status == "completed" else "response.incomplete")
    deltas = [e for e in evs if e.type == "response.output_text.delta"]
    assert deltas
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", last,
    ]  # fmt: skip
    seqs = [e.sequence_number for e in evs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text
    (done,) = [e for e in evs if e.type == "response.output_text.done"]
    assert done.text == text
    item_id = evs[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 for d in deltas)
    created, final = evs[0].response, evs[-1].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert final.id == created.id and final.output_text == text
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    if last == "response.completed":
        assert stream.get_final_response().output_text == text


def test_max_output_tokens_cuts_the_answer_short_as_incomplete(client) -> None:
    kw = {"model": DEFAULT_MODEL, "input": "Tell me a long story about a dragon.",
          "max_output_tokens": 3, "temperature": 0}  # fmt: skip
    r = client.responses.create(**kw)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete" and r.output_text
    # Streamed: ends with response.incomplete, carrying the same.
    last = list(client.responses.create(stream=True, **kw))[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete" and last.response.output_text == r.output_text
    assert last.response.incomplete_details.reason == "max_output_tokens"


def test_text_format_json_schema_constrains_the_answer(client) -> None:
    for seed in range(2):
        r = client.responses.create(
            model=DEFAULT_MODEL, input="Describe a sailor from Lisbon as a person record.",
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                             "strict": True}},
            max_output_tokens=60, extra_body={"seed": seed},
        )  # fmt: skip
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), PERSON)
        assert r.text.format.type == "json_schema"
    r = client.responses.create(
        model=DEFAULT_MODEL, input="A JSON object about a cat.",
        text={"format": {"type": "json_object"}}, max_output_tokens=40,
        extra_body={"seed": 1},
    )  # fmt: skip
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.output_text.startswith("{")


def test_a_required_call_and_its_output_sent_back_give_a_text_answer(client) -> None:
    r = client.responses.create(
        model=DEFAULT_MODEL,
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        extra_body={"seed": 1},
    )
    assert r.status == "completed"
    (call,) = r.output  # only a call: no message
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.output_text == ""
    # The call and its result back, as the docs show it (output items appended as is).
    history = [
        {"role": "user", "content": QUESTION},
        *r.output,
        {"type": "function_call_output", "call_id": call.call_id,
         "output": '{"celsius": 18, "sky": "cloudy"}'},
    ]  # fmt: skip
    final = client.responses.create(
        model=DEFAULT_MODEL, input=history, tools=TOOLS, tool_choice="none",
        max_output_tokens=40, temperature=0,
    )  # fmt: skip
    assert [o.type for o in final.output] == ["message"]
    assert final.output_text.strip()
    assert "<tool_call>" not in final.output_text
    # The same history as chat messages: the same prompt, the same greedy answer.
    chat = client.chat.completions.create(
        model=DEFAULT_MODEL, max_tokens=40, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
               for t in TOOLS],
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id,
             "content": '{"celsius": 18, "sky": "cloudy"}'},
        ],
    )  # fmt: skip
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    assert final.output_text == chat.choices[0].message.content


def test_a_streamed_call_comes_as_its_item_events(client) -> None:
    kw = {"model": DEFAULT_MODEL, "input": QUESTION, "tools": TOOLS,
          "tool_choice": {"type": "function", "name": "get_weather"},
          "extra_body": {"seed": 7}}  # fmt: skip
    whole = client.responses.create(**kw)
    (expected,) = whole.output
    with client.responses.stream(**kw) as stream:
        evs = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    added, delta, done, item_done = evs[2:6]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert added.item.status == "in_progress" and added.item.name == "get_weather"
    assert delta.item_id == done.item_id == added.item.id == item_done.item.id
    assert delta.delta == done.arguments == item_done.item.arguments
    assert json.loads(done.arguments) == json.loads(expected.arguments)
    (call,) = final.output
    assert call.type == "function_call" and call.call_id == added.item.call_id
    assert call.call_id.startswith("call_")


def _post(via: NodeProc, body: dict) -> httpx.Response:
    return httpx.post(via.api + "/v1/responses", json=body, timeout=60)


@pytest.mark.parametrize(
    ("over", "param", "code"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "unsupported_parameter"),
        ({"conversation": "conv_123"}, "conversation", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name", None),
        ({"temperature": 2.5}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
         "input[0].content[1].image_url", None),  # nodes never fetch
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0].type", "unsupported_parameter"),
        ({"input": [{"type": "function_call_output", "call_id": "call_1",
                     "output": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].output[0].type", "unsupported_parameter"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type",
         "unsupported_parameter"),
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", None),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(via: NodeProc, over, param, code) -> None:
    r = _post(via, {"model": DEFAULT_MODEL, "input": "Hi", "max_output_tokens": 4, **over})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code, err


def test_the_client_raises_on_refusals_with_what_to_do_instead(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=DEFAULT_MODEL, input="Hi again", previous_response_id="resp_abc"
        )
    assert e.value.body["param"] == "previous_response_id"
    assert "whole conversation" in e.value.body["message"] and "input" in e.value.body["message"]
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as nf:
            client.responses.create(model="no-such-model", input="Hi", stream=stream)
        assert nf.value.body["code"] == "model_not_found"
        assert DEFAULT_MODEL in nf.value.body["message"]

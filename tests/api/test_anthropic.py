"""Anthropic Messages through the official ``anthropic`` SDK, on the default model split
over two nodes and asked of a third that holds no stage."""

from __future__ import annotations

import json

import httpx
import pytest

from meshd.api.anthropic import system_prompt
from meshd.models.resolve import DEFAULT_MODEL
from tests.api.reference import WEATHER, greedy_chat

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "Say hello in one short sentence."}]
GREEDY = {"temperature": 0}  # the 2.x SDK sends sampling through extra_body
#: Fewer tokens than the greedy answer to HI has: it ends by length.
N = 8
TOOLS = [{"name": "get_weather", "description": "The current weather in a city",
          "input_schema": WEATHER}]  # fmt: skip


def test_a_message_matches_the_openai_route(ac, via) -> None:
    m = ac.messages.create(model=DEFAULT_MODEL, max_tokens=N, messages=HI, extra_body=GREEDY,
                           system="You are a friendly assistant.")  # fmt: skip
    ref = greedy_chat(via, [{"role": "system", "content": "You are a friendly assistant."}, *HI], N)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text"
    assert m.content[0].text == ref["choices"][0]["message"]["content"]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == N


def test_the_stop_sequence_that_ended_the_answer_is_named(ac) -> None:
    m = ac.messages.create(model=DEFAULT_MODEL, max_tokens=40, messages=HI, extra_body=GREEDY,
                           stop_sequences=["zzz", " "])  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " "
    assert " " not in m.content[0].text


def test_streaming_follows_anthropics_event_sequence(ac) -> None:
    whole = ac.messages.create(model=DEFAULT_MODEL, max_tokens=N, messages=HI, extra_body=GREEDY)
    with ac.messages.stream(model=DEFAULT_MODEL, max_tokens=N, messages=HI,
                            extra_body=GREEDY) as s:  # fmt: skip
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"] or kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == N and final.stop_reason == "max_tokens"


def test_raw_stream_has_ping_and_event_lines(via) -> None:
    body = {"model": DEFAULT_MODEL, "max_tokens": 5, "messages": HI, "stream": True}
    # Claude Code posts to /v1/messages?beta=true.
    with httpx.stream("POST", via.api + "/v1/messages?beta=true", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("event: ")]
    names = [ln.removeprefix("event: ") for ln in lines]
    assert names[0] == "message_start" and names[1] == "ping" and names[-1] == "message_stop"


def test_tool_use_then_tool_result(ac) -> None:
    asked = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    m = ac.messages.create(model=DEFAULT_MODEL, max_tokens=80, messages=asked, tools=TOOLS,
                           tool_choice={"type": "any"}, extra_body={"seed": 1})  # fmt: skip
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)
    history = [
        *asked,
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": '{"celsius": 18, "sky": "cloudy"}'}]},
    ]  # fmt: skip
    final = ac.messages.create(model=DEFAULT_MODEL, max_tokens=30, messages=history,
                               tools=TOOLS, tool_choice={"type": "none"})  # fmt: skip
    assert final.content[0].type == "text" and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_a_named_tool_streams_as_input_json(ac) -> None:
    with ac.messages.stream(
        model=DEFAULT_MODEL, max_tokens=80, tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    ) as s:  # fmt: skip
        final = s.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and final.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)


def test_structured_output_through_messages_parse(ac) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    # The SDK sends output_config.format with the model's JSON Schema, and reads the
    # answer's text back into the model. Greedy: a sampled run of this small model may
    # write an integer's digits until max_tokens (valid JSON, never finished).
    m = ac.messages.parse(model=DEFAULT_MODEL, max_tokens=100, output_format=Person,
                          messages=[{"role": "user", "content": "A person, as JSON."}],
                          extra_body=GREEDY)  # fmt: skip
    assert m.stop_reason == "end_turn"
    assert isinstance(m.parsed_output, Person)
    schema = {"type": "object", "properties": {"city": {"type": "string"},
              "sunny": {"type": "boolean"}}, "required": ["city", "sunny"],
              "additionalProperties": False}  # fmt: skip
    # The structured-outputs beta's spelling: a top-level output_format, streamed here.
    asked = [{"role": "user", "content": "The weather in Paris, as JSON."}]
    beta = {"output_format": {"type": "json_schema", "schema": schema}}
    with ac.messages.stream(model=DEFAULT_MODEL, max_tokens=100, messages=asked,
                            extra_body={**GREEDY, **beta}) as s:  # fmt: skip
        final = s.get_final_message()
    assert final.stop_reason == "end_turn"
    jsonschema.validate(json.loads(final.content[0].text), schema)


def test_count_tokens_matches_what_a_message_reads(ac) -> None:
    system = "You are terse."
    n = ac.messages.count_tokens(model=DEFAULT_MODEL, messages=HI, system=system).input_tokens
    m = ac.messages.create(model=DEFAULT_MODEL, max_tokens=1, messages=HI, system=system)
    # Tokens read from the prefix cache are counted apart, as Anthropic counts them.
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert m.usage.input_tokens > 0
    with_tools = ac.messages.count_tokens(model=DEFAULT_MODEL, messages=HI, tools=TOOLS)
    assert with_tools.input_tokens > n


def test_claude_codes_per_request_nonce_is_dropped(ac) -> None:
    nonce = "x-anthropic-billing-header: cc_version=2.1.37; cch=%s;"
    counts = {
        ac.messages.count_tokens(
            model=DEFAULT_MODEL, messages=HI,
            system=[{"type": "text", "text": nonce % tag}, {"type": "text", "text": "Be brief."}],
        ).input_tokens
        for tag in ("1a2b3c", "ffffffffffffffffff")
    }  # fmt: skip
    plain = ac.messages.count_tokens(model=DEFAULT_MODEL, messages=HI, system="Be brief.")
    assert counts == {plain.input_tokens}
    assert system_prompt("x-anthropic-a: 1\nKeep this.") == "Keep this."


def test_x_api_key_and_errors_in_anthropics_shape(via) -> None:
    ac = anthropic.Anthropic(base_url=via.api, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.NotFoundError) as e:
        ac.messages.create(model="no-such-model", max_tokens=5, messages=HI)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"
    assert DEFAULT_MODEL in e.value.body["error"]["message"]
    bodies = [
        {"model": DEFAULT_MODEL, "messages": HI},  # no max_tokens
        {"model": DEFAULT_MODEL, "max_tokens": 5, "messages": HI, "temperature": 1.5},
        {"model": DEFAULT_MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "aGk="}}]}]},
        {"model": DEFAULT_MODEL, "max_tokens": 5, "messages": HI,
         "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"model": DEFAULT_MODEL, "max_tokens": 5, "messages": HI,
         "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS},
        {"model": DEFAULT_MODEL, "max_tokens": 5, "messages": HI,
         "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
    ]  # fmt: skip
    for body in bodies:
        r = httpx.post(via.api + "/v1/messages", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"]


def test_turn_two_reads_turn_one_from_the_prefix_cache(ac, via) -> None:
    system = "You are a patient tutor who explains things to children in plain words."
    turn1 = [{"role": "user", "content": "Why is the sky blue?"}]
    # Unasked, every request uses the cache; the package's instance is exact, and this
    # request says not.
    warm = {"exact": False}
    m1 = ac.messages.create(model=DEFAULT_MODEL, max_tokens=24, system=system, messages=turn1,
                            extra_body=warm)  # fmt: skip
    history = [
        *turn1,
        {"role": "assistant", "content": m1.content[0].text},
        {"role": "user", "content": "And why are sunsets red?"},
    ]
    m2 = ac.messages.create(model=DEFAULT_MODEL, max_tokens=8, system=system, messages=history,
                            extra_body=warm)  # fmt: skip
    total1 = m1.usage.input_tokens + m1.usage.cache_read_input_tokens
    # At least all of turn 1's prompt comes from the cache; turn 2 computes the rest.
    assert m2.usage.cache_read_input_tokens >= total1
    assert m2.usage.input_tokens > 0
    metrics = httpx.get(via.api + "/metrics", timeout=10).text
    hits = [ln for ln in metrics.splitlines() if ln.startswith("meshd_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 1

"""A thinking model's thoughts apart from its answer, in each dialect's own shape,
through the official clients (``openai``, ``anthropic``, ``ollama``), whole and
streamed, on and off.

The default model does not think: here it runs under a template that does
(Qwen3's ChatML shape, ``enable_thinking`` and past thoughts included), placed whole on
node a. A turn that starts with the drill's marker (``tests/api/conftest.py``) makes
node a's last stage write the rest of it as the model's output, so the thoughts are
known; turns without it run the real model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import SCRIPT
from tests.api.reference import WEATHER
from tests.cluster import NodeProc, wait_for
from tests.synthetic import with_chat_template

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

pytestmark = pytest.mark.timeout(300)

#: Qwen3's shape, written for this test: past thoughts shown, and thoughts turned off
#: by the template's own switch.
THINKER = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' and m.reasoning_content %}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
THOUGHTS = "The user says hi: I greet them back."
ANSWER = "Hello there!"
#: The model thinks, answers, and ends (<|im_end|> is its end token).
OUTPUT = f"<think>\n{THOUGHTS}\n</think>\n\n{ANSWER}<|im_end|>"
SCRIPTED = [{"role": "user", "content": SCRIPT + OUTPUT}]
PLAIN = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def thinker(trio: dict[str, NodeProc], a_models: Path, model_path: Path) -> Iterator[str]:
    """The default model's weights under THINKER, placed whole on node a."""
    path = with_chat_template(model_path, a_models / "thinker.gguf", THINKER)
    owner, via = trio["a"].api, trio["c"]
    r = httpx.post(owner + "/v1/instances", json={"model": str(path), "nodes": ["a"]}, timeout=60)
    assert r.status_code == 201, r.text
    stages = f"/v1/instances/{r.json()['id']}"
    try:
        wait_for(lambda: all(s["state"] == "ready" for s in via.get(stages)["stages"]), 90, 0.2)
        yield str(path)
    finally:
        httpx.delete(owner + stages, timeout=10)


def test_chat_completions_give_thoughts_apart_whole_and_streamed(client, thinker) -> None:
    r = client.chat.completions.create(model=thinker, messages=SCRIPTED, max_tokens=60)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (THOUGHTS, ANSWER)
    assert r.choices[0].finish_reason == "stop"
    n = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < n < r.usage.completion_tokens
    thoughts = text = ""
    for chunk in client.chat.completions.create(
        model=thinker, messages=SCRIPTED, max_tokens=60, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens_details.reasoning_tokens == n
        for c in chunk.choices:
            thoughts += getattr(c.delta, "reasoning_content", None) or ""
            text += c.delta.content or ""
    assert (thoughts, text) == (THOUGHTS, ANSWER)


def test_enable_thinking_false_renders_the_prompt_without_thoughts(client, thinker) -> None:
    # The real model: the switch is the template's own, so the prompt itself changes.
    on = client.chat.completions.create(model=thinker, messages=PLAIN, max_tokens=4, seed=1)
    off = client.chat.completions.create(
        model=thinker, messages=PLAIN, max_tokens=4, seed=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    shut = len("<think>\n\n</think>\n\n")  # a few tokens, fewer than characters
    assert on.usage.prompt_tokens < off.usage.prompt_tokens < on.usage.prompt_tokens + shut
    assert off.choices[0].message.content
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_a_schema_holds_the_answer_after_the_thoughts(client, thinker) -> None:
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 12}},
              "required": ["greeting"], "additionalProperties": False}  # fmt: skip
    r = client.chat.completions.create(
        model=thinker, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": f"{SCRIPT}<think>\nJSON it is.\n</think>\n\n"}],
        response_format={"type": "json_schema", "json_schema": {"name": "g", "schema": schema}},
    )  # fmt: skip
    m = r.choices[0].message
    assert m.reasoning_content == "JSON it is."
    assert set(json.loads(m.content)) == {"greeting"}


def test_a_tool_call_after_the_thoughts_is_still_found(client, thinker) -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    turn = f"{SCRIPT}<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    r = client.chat.completions.create(
        model=thinker, messages=[{"role": "user", "content": turn + "<|im_end|>"}],
        tools=tools, max_tokens=80,
    )  # fmt: skip
    m = r.choices[0].message
    assert m.reasoning_content == "Need the weather."
    assert [c.function.name for c in m.tool_calls] == ["get_weather"]
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls"


def test_past_thoughts_are_taken_back_in_every_dialect(client, ac, oc, thinker, via) -> None:
    said = {"role": "assistant", "content": "Hello!"}
    bare = client.chat.completions.create(
        model=thinker, max_tokens=1, messages=[*PLAIN, said, *PLAIN]
    )
    back = client.chat.completions.create(
        model=thinker, max_tokens=1,
        messages=[*PLAIN, {**said, "reasoning_content": "They greet."}, *PLAIN],
    )  # fmt: skip
    assert back.usage.prompt_tokens > bare.usage.prompt_tokens  # the template shows them
    thought = {"type": "thinking", "thinking": "They greet.", "signature": "x"}
    m = ac.messages.create(model=thinker, max_tokens=1, messages=[
        *PLAIN, {"role": "assistant", "content": [thought, {"type": "text", "text": "Hello!"}]},
        *PLAIN])  # fmt: skip
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == back.usage.prompt_tokens
    o = oc.chat(model=thinker, options={"num_predict": 1},
                messages=[*PLAIN, {**said, "thinking": "They greet."}, *PLAIN])  # fmt: skip
    assert o.prompt_eval_count == back.usage.prompt_tokens
    items = [*PLAIN, {"type": "reasoning", "id": "rs_1", "summary": [],
                      "content": [{"type": "reasoning_text", "text": "They greet."}]},
             said, *PLAIN]  # fmt: skip
    rr = client.responses.create(model=thinker, input=items, max_output_tokens=1)
    assert rr.usage.input_tokens == back.usage.prompt_tokens


def test_responses_give_a_reasoning_item_before_the_message(client, thinker) -> None:
    r = client.responses.create(model=thinker, input=SCRIPTED, max_output_tokens=60)
    kinds = [i.type for i in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHTS and r.output[0].summary == []
    assert r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model=thinker, input=SCRIPTED, max_output_tokens=60) as s:
        evs = list(s)
        final = s.get_final_response()
    deltas = "".join(e.delta for e in evs if e.type == "response.reasoning_text.delta")
    assert deltas == THOUGHTS
    assert [i.type for i in final.output] == kinds
    assert final.output[0].content[0].text == THOUGHTS and final.output_text == ANSWER


def test_anthropic_gives_a_thinking_block_and_honours_its_budget(ac, thinker) -> None:
    m = ac.messages.create(model=thinker, max_tokens=60, messages=SCRIPTED,
                           thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == THOUGHTS and m.content[0].signature
    assert m.content[1].text == ANSWER and m.stop_reason == "end_turn"
    with ac.messages.stream(model=thinker, max_tokens=60, messages=SCRIPTED) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert {"thinking_delta", "signature_delta", "text_delta"} <= set(kinds)
    assert kinds.index("signature_delta") < kinds.index("text_delta")
    assert final.content[0].thinking == THOUGHTS and final.content[1].text == ANSWER
    # The real model thinks on after an opened <think> until its budget closes it.
    opened = [{"role": "user", "content": f"{SCRIPT}<think>\n"}]
    m = ac.messages.create(model=thinker, max_tokens=24, messages=opened,
                           extra_body={"temperature": 0},
                           thinking={"type": "enabled", "budget_tokens": 8})  # fmt: skip
    assert [b.type for b in m.content] == ["thinking", "text"], m.content
    assert m.content[0].thinking and m.content[1].text


def test_ollama_shows_thinking_and_think_false_turns_it_off(oc, thinker) -> None:
    r = oc.chat(model=thinker, messages=SCRIPTED, think=True)
    assert (r.message.thinking, r.message.content) == (THOUGHTS, ANSWER)
    parts = list(oc.chat(model=thinker, messages=SCRIPTED, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHTS
    assert "".join(p.message.content for p in parts) == ANSWER
    g = oc.generate(model=thinker, prompt=SCRIPTED[0]["content"])
    assert (g.thinking, g.response) == (THOUGHTS, ANSWER)
    on = oc.chat(model=thinker, messages=PLAIN, options={"num_predict": 2})
    off = oc.chat(model=thinker, messages=PLAIN, think=False, options={"num_predict": 2})
    assert off.prompt_eval_count > on.prompt_eval_count and off.message.thinking is None

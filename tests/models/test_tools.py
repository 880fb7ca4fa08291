"""Tool-call formats: detection from the template, rendering, and reading calls back,
whole and streamed piece by piece."""

from __future__ import annotations

import json

import pytest

from meshd.models.chat import render_chat
from meshd.models.tools import (
    ParsedCall,
    ToolCallParser,
    forced_call_lark,
    template_messages,
    tool_format,
)

# A compact template in the style of Qwen 2.5's (tools listed in the system turn,
# calls as <tool_call> blocks, results as tool turns).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t | tojson }}"
    "{%- endfor %}\nCall with <tool_call>{...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"c": -3}'},
]


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (None, "generic"),
        ("{{ messages }}", "generic"),
        (HERMES_TEMPLATE, "hermes"),
        ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
        ("{% if tools %}Environment: ipython{% endif %}<|python_tag|>", "llama3"),
    ],
)
def test_the_format_is_read_from_the_template(template, fmt) -> None:
    assert tool_format(template) == fmt


def _feed_all(fmt: str, text: str, step: int) -> list[str | ParsedCall]:
    p = ToolCallParser(fmt)  # type: ignore[arg-type]
    out: list[str | ParsedCall] = []
    for i in range(0, len(text), step):
        out += p.feed(text[i : i + step])
    return out + p.finish()


def _merge(parts: list[str | ParsedCall]) -> list[str | ParsedCall]:
    out: list[str | ParsedCall] = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


CASES = [
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        ["Let me look.\n", ParsedCall("get_weather", '{"city": "Oslo"}'), "\n",
         ParsedCall("f", "{}")],
    ),
    ("hermes", "a < b, and <tool_ is not a tag", ["a < b, and <tool_ is not a tag"]),
    (
        "hermes",  # a call cut short by the end token still counts
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}',
        [ParsedCall("f", '{"x": 1}')],
    ),
    (
        "hermes",  # a block that is not a call stays text
        "<tool_call>not json</tool_call>",
        ["<tool_call>not json</tool_call>"],
    ),
    (
        "generic",
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>',
        [ParsedCall("f", '{"x": 2}')],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        [ParsedCall("get_weather", '{"city": "Rome"}')],
    ),
    (
        "llama3",
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": [1]}}',
        [ParsedCall("a", "{}"), ParsedCall("b", '{"k": [1]}')],
    ),
    ("llama3", '{"answer": 42}', ['{"answer": 42}']),
    ("llama3", "Plain text answer.", ["Plain text answer."]),
    (
        "mistral",
        '[{"name": "get_weather", "arguments": {"city": "Bern"}}]',
        [ParsedCall("get_weather", '{"city": "Bern"}')],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_calls_are_read_the_same_whole_or_streamed(fmt, text, expected, step) -> None:
    assert _merge(_feed_all(fmt, text, step)) == expected


def test_streamed_content_is_not_held_longer_than_a_possible_tag() -> None:
    p = ToolCallParser("hermes")
    assert p.feed("Hello there") == ["Hello there"]
    assert p.feed(" <tool") == [" "]  # "<tool" may open a call
    assert p.feed("box>") == ["<toolbox>"]


def test_a_template_with_tools_gets_them_and_the_history_as_transformers_passes_it() -> None:
    messages, tools = template_messages(HISTORY, TOOLS, "hermes")
    assert tools == [{"type": "function", "function": TOOLS[0]}]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    text = render_chat(HERMES_TEMPLATE, messages, tools=tools)
    assert '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert '<|im_start|>tool{"c": -3}<|im_end|>' in text


def test_a_template_without_tools_gets_the_generic_prompt_and_hermes_history() -> None:
    system = {"role": "system", "content": "Be brief."}
    messages, tools = template_messages([system, *HISTORY], TOOLS, "generic")
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(TOOLS[0]) in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert messages[3]["content"] == '<tool_response>\n{"c": -3}\n</tool_response>'
    # No tools offered (tool_choice "none"): the history is shown, no prompt is added.
    shown, _ = template_messages(HISTORY, [], "generic")
    assert [m["role"] for m in shown] == ["user", "assistant", "user"]


def test_consecutive_user_turns_are_merged_for_strict_templates() -> None:
    history = [*HISTORY, {"role": "user", "content": "And in Bergen?"}]
    messages, _ = template_messages(history, TOOLS, "generic")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[-1]["content"].endswith("\n\nAnd in Bergen?")


@pytest.mark.parametrize("fmt", ["hermes", "generic", "llama3", "mistral"])
def test_the_forced_call_grammar_is_lark_around_the_arguments_schema(fmt) -> None:
    lark = forced_call_lark(TOOLS, fmt, "get_weather")  # type: ignore[arg-type]
    assert "%json" in lark and '"const": "get_weather"' in lark
    assert ("<tool_call>" in lark) == (fmt in ("hermes", "generic"))
    assert ('"parameters"' in lark) == (fmt == "llama3")

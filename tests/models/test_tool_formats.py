"""Every tool-call format a template can show: told apart from the template, and read
back from answers in the shape the models write them, whole and streamed in any
chunking (markers split anywhere), several calls to an answer, text around them."""

from __future__ import annotations

import json
import random

import pytest

from meshd.models.chat import render_chat
from meshd.models.tools import ParsedCall, ToolCallParser, template_messages, tool_format

# Template snippets in each family's style (written for these tests: only the
# telltales a real template of the family holds matter).
TEMPLATES = {
    "hermes": "{% if tools %}{{ tools | tojson }} Call: <tool_call>{json}</tool_call>{% endif %}",
    "qwen3_coder": (
        "{% if tools %}Reply with <tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n"
        "</parameter>\n</function>\n</tool_call>{% endif %}"
    ),
    "glm45": (
        "[gMASK]<sop>{% if tools %}<tools>{{ tools | tojson }}</tools> Write <tool_call>NAME"
        "<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>{% endif %}"
    ),
    "pythonic": (
        "<|header_start|>system<|header_end|>{% if tools %}Call them as "
        "[func_name1(param1=value1), func_name2(param=value)]{% endif %}"
        "{% for m in messages %}{% if m.role == 'tool' %}<|header_start|>ipython"
        "<|header_end|>{% endif %}{% endfor %}"
    ),
    "deepseek_r1": (
        "{% for m in messages %}{% if m.tool_calls %}<｜tool▁calls▁begin｜>"
        "{% for c in m.tool_calls %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        "{{ c.function.name }}\n```json\n{{ c.function.arguments }}\n```<｜tool▁call▁end｜>"
        "{% endfor %}<｜tool▁calls▁end｜>{% endif %}{% endfor %}"
    ),
    "deepseek_v31": (
        "{% for m in messages %}{% if m.tool_calls %}<｜tool▁calls▁begin｜>"
        "{% for c in m.tool_calls %}{{ '<｜tool▁call▁begin｜>' + c.function.name + "
        "'<｜tool▁sep｜>' + c.function.arguments + '<｜tool▁call▁end｜>' }}{% endfor %}"
        "<｜tool▁calls▁end｜>{% endif %}{% endfor %}"
    ),
    "harmony": (
        "{% if tools %}namespace functions {}{% endif %}<|start|>assistant<|channel|>"
        "commentary to=functions.x <|constrain|>json<|message|>{}<|call|>"
    ),
    "granite": (
        "{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}"
        "{% endif %}<|start_of_role|>assistant<|end_of_role|><|tool_call|>"
    ),
    "kimi_k2": (
        "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}{% endif %}"
        "<|tool_calls_section_begin|><|tool_call_begin|>{{ id }}<|tool_call_argument_begin|>"
    ),
    "command_r": (
        "{% if tools %}## Available Tools{% endif %}Write 'Action:' and a list of "
        '{"tool_name": ..., "parameters": ...}'
    ),
    "command_r7b": (
        "{% if tools %}## Available Tools{% endif %}<|START_THINKING|><|END_THINKING|>"
        '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "x"}]<|END_ACTION|>'
    ),
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",
    "llama3": "{% if tools %}Environment: ipython{% endif %}<|python_tag|>",
}


@pytest.mark.parametrize(("fmt", "template"), TEMPLATES.items())
def test_each_family_is_told_from_its_template(fmt: str, template: str) -> None:
    assert tool_format(template) == fmt


def test_a_template_without_tools_or_telltales_stays_generic() -> None:
    assert tool_format(None) == "generic"
    assert tool_format("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") == (
        "generic"
    )
    # Hermes' tags in a template that never takes tools: as before, generic.
    assert tool_format("<tool_call>{{ messages }}</tool_call>") == "generic"


WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "where": {"type": "object"},
            "tags": {"type": "array"},
            "zip": {"type": "string"},
            "note": {"type": ["string", "null"]},
        },
    },
}
TOOLS = [WEATHER, {"name": "noop"}]
NESTED = {"lat": 48.85, "box": {"n": [1, 2, {"deep": None}]}, "s": "a}b]c"}
NESTED_JSON = json.dumps(NESTED)


def call(name: str, **args: object) -> ParsedCall:
    return ParsedCall(name, json.dumps(args))


# (format, the model's answer, what is read from it)
CASES = [
    (
        "qwen3_coder",
        "I will look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=where>\n"
        f"{NESTED_JSON}\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>\nDone.",
        ["I will look that up.\n",
         call("get_weather", city="New York", days=3, where=NESTED, zip="01234"),
         "\n", call("noop"), "\nDone."],
    ),
    (
        "qwen3_coder",  # a value over several lines, and a parameter left open
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n"
        "</parameter>\n<parameter=metric>\ntrue\n<parameter=note>\nnull\n</function>\n"
        "</tool_call>",
        [call("get_weather", city="line one\nline two", metric=True, note=None)],
    ),
    (
        "glm45",
        "Checking both.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
        "</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"a\", \"b\"]</arg_value>\n"
        f"<arg_key>where</arg_key>\n<arg_value>{NESTED_JSON}</arg_value>\n</tool_call>"
        "<tool_call>noop\n</tool_call>",
        ["Checking both.", call("get_weather", city="Paris", tags=["a", "b"], where=NESTED),
         call("noop")],
    ),
    (
        "pythonic",
        f'[get_weather(city="Paris", days=3, where={NESTED_JSON}), '
        "noop(), get_weather(city='Rome', metric=True, tags=['x', \"]\"])]",
        [call("get_weather", city="Paris", days=3, where=NESTED), call("noop"),
         call("get_weather", city="Rome", metric=True, tags=["x", "]"])],
    ),
    (
        "pythonic",
        "Let me check. <|python_start|>[get_weather(city=\"Oslo\")]<|python_end|> Back soon.",
        ["Let me check. ", call("get_weather", city="Oslo"), " Back soon."],
    ),
    ("pythonic", "See [1], [the docs](x) and [a, b].", ["See [1], [the docs](x) and [a, b]."]),
    (
        "deepseek_r1",
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        f"```json\n{{\"city\": \"Paris\", \"where\": {NESTED_JSON}}}\n```<｜tool▁call▁end｜>\n"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>noop\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        ["Sure.", call("get_weather", city="Paris", where=NESTED), call("noop")],
    ),
    (
        "deepseek_v31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        f"{{\"city\": \"Paris\", \"where\": {NESTED_JSON}}}<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>noop<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        [call("get_weather", city="Paris", where=NESTED), call("noop")],
    ),
    (
        "harmony",
        "<|channel|>analysis<|message|>User wants weather. Call it.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        f"{{\"city\": \"Paris\", \"where\": {NESTED_JSON}}}<|call|>",
        ["<|channel|>analysis<|message|>User wants weather. Call it.<|end|>",
         call("get_weather", city="Paris", where=NESTED)],
    ),
    (
        "harmony",  # the recipient in the role's header, and a final answer after
        ' to=functions.noop<|channel|>commentary json<|message|>{}<|call|><|start|>assistant'
        "<|channel|>final<|message|>Nothing to do.<|return|>",
        [call("noop"), "Nothing to do."],
    ),
    (
        "granite",
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {{"city": "Paris", "where": '
        f'{NESTED_JSON}}}}}, {{"name": "noop", "arguments": {{}}}}]',
        [call("get_weather", city="Paris", where=NESTED), call("noop")],
    ),
    (
        "kimi_k2",
        "Let me see.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        f'<|tool_call_argument_begin|>{{"city": "Paris", "where": {NESTED_JSON}}}'
        "<|tool_call_end|><|tool_call_begin|>functions.noop:1<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>",
        ["Let me see.", call("get_weather", city="Paris", where=NESTED), call("noop")],
    ),
    (
        "command_r",
        'Action: ```json\n[\n    {\n        "tool_name": "get_weather",\n        '
        f'"parameters": {{"city": "Paris", "where": {NESTED_JSON}}}\n    }},\n    {{\n'
        '        "tool_name": "noop",\n        "parameters": {}\n    }\n]\n```',
        [call("get_weather", city="Paris", where=NESTED), call("noop")],
    ),
    ("command_r", "Action: none needed, it is 4.", ["Action: none needed, it is 4."]),
    (
        "command_r7b",
        "<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", "
        f'"parameters": {{"city": "Paris", "where": {NESTED_JSON}}}}},\n    '
        '{"tool_call_id": "1", "tool_name": "noop", "parameters": {}}\n]<|END_ACTION|>',
        [call("get_weather", city="Paris", where=NESTED), call("noop")],
    ),
    (
        "hermes",
        f'Both.\n<tool_call>\n{{"name": "get_weather", "arguments": {{"where": {NESTED_JSON}}}}}'
        '\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
        ["Both.\n", call("get_weather", where=NESTED), "\n", call("noop")],
    ),
]  # fmt: skip


def _merge(parts: list[str | ParsedCall]) -> list[str | ParsedCall]:
    out: list[str | ParsedCall] = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


def _read(fmt: str, chunks: list[str]) -> list[str | ParsedCall]:
    p = ToolCallParser(fmt, TOOLS)  # type: ignore[arg-type]
    out: list[str | ParsedCall] = []
    for c in chunks:
        out += p.feed(c)
    return _merge(out + p.finish())


def _chunkings(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and cut at random places (seeded)."""
    out = [[text], list(text)]
    for seed in range(6):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 40))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES)
def test_calls_are_read_the_same_whole_or_in_any_chunking(fmt, text, expected) -> None:
    for chunks in _chunkings(text):
        assert _read(fmt, chunks) == expected, chunks


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
        ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"city": "Par'),
        ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'),
        ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city"'),
        ("command_r7b", '<|START_ACTION|>[{"tool_name": "get_weather", "para'),
        ("pythonic", '[get_weather(city="Par'),
        ("harmony", "<|channel|>commentary to=functions.get_weather json<|message|>{\"ci"),
        ("glm45", "<tool_call>get weather now"),
    ],
)  # fmt: skip
def test_a_call_that_does_not_parse_is_given_back_as_text(fmt, text) -> None:
    assert _read(fmt, list(text)) == [text]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("qwen3_coder", "<tool_call>\n<function=noop>\n</function>"),
        ("deepseek_r1", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>noop\n```json\n{}\n```"),
        ("kimi_k2", "<|tool_call_begin|>functions.noop:0<|tool_call_argument_begin|>{}"),
        ("command_r7b", '<|START_ACTION|>[{"tool_name": "noop", "parameters": {}}]'),
        ("glm45", "<tool_call>noop"),
        ("harmony", "<|channel|>commentary to=functions.noop <|constrain|>json<|message|>{}"),
    ],
)
def test_a_call_cut_short_by_the_end_token_still_counts(fmt, text) -> None:
    assert _read(fmt, [text]) == [call("noop")]


def test_raw_values_take_their_types_from_the_schema() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n07\n</parameter>\n"  # no JSON
        "<parameter=zip>\n01234\n</parameter>\n<parameter=unknown>\n5\n</parameter>\n"
        "<parameter=note>\nnull\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    [parsed] = _read("qwen3_coder", [text])
    assert isinstance(parsed, ParsedCall)
    # An integer that is no JSON stays as written; strings and unknown names stay strings.
    assert json.loads(parsed.arguments) == {
        "days": "07", "zip": "01234", "unknown": "5", "note": None, "metric": False,
    }  # fmt: skip


def test_pythonic_calls_take_literals_only() -> None:
    for text in (
        '[get_weather(city=__import__("os").getcwd())]',
        "[get_weather(city=open('/etc/passwd').read())]",
        "[get_weather(**{'city': 'x'})]",
        "[get_weather('Paris')]",
    ):
        assert _read("pythonic", [text]) == [text]


def test_a_bracket_that_cannot_open_a_call_is_shown_at_once() -> None:
    p = ToolCallParser("pythonic")
    assert p.feed("Items: [") == ["Items: "]
    assert p.feed("1") == ["[", "1"]
    assert p.feed("]") + p.finish() == ["]"]
    assert ToolCallParser("pythonic").feed("[get_weather(") == []  # may be a call: held


def test_harmony_final_text_streams_without_its_markup() -> None:
    p = ToolCallParser("harmony")
    assert p.feed("<|channel|>final<|message|>Hello") == ["Hello"]
    assert p.feed(" there<|re") == [" there"]
    assert p.feed("turn|>") + p.finish() == []


def test_harmony_reasoning_is_passed_on_and_never_a_call() -> None:
    text = "<|channel|>analysis<|message|>to=functions.get_weather {}<|end|>"
    assert _read("harmony", list(text)) == [text]


def test_deepseek_templates_get_the_arguments_as_the_json_text_they_join() -> None:
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    ]  # fmt: skip
    messages, _ = template_messages(history, [WEATHER], "deepseek_v31")
    text = render_chat(TEMPLATES["deepseek_v31"], messages, add_generation_prompt=False)
    assert '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}' in text
    messages, _ = template_messages(history, [WEATHER], "qwen3_coder")
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_kimi_history_names_calls_and_their_results_as_kimi_does() -> None:
    history = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "noop", "arguments": "{}"}},
            {"id": "call_b", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_b", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_a", "content": "ok"},
    ]  # fmt: skip
    messages, _ = template_messages(history, TOOLS, "kimi_k2")
    assert [c["id"] for c in messages[0]["tool_calls"]] == [
        "functions.noop:0", "functions.get_weather:1",
    ]  # fmt: skip
    assert [m["tool_call_id"] for m in messages[1:]] == [
        "functions.get_weather:1",
        "functions.noop:0",
    ]
    assert history[0]["tool_calls"][0]["id"] == "call_a"  # the request's own is left alone

"""A call cut short by the token limit: dropped, markup and all, in every tool format
(in-process: :class:`meshd.api.toolcalls.ChoiceCalls` over the model-format parser)."""

from __future__ import annotations

import pytest

from meshd.api.toolcalls import ChoiceCalls

#: One call to get_weather, as each format writes it (a forced call's grammar writes
#: exactly these), after a little text where the format allows text before a call.
CALLS = {
    "generic": 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call>",
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}
#: The text before the call, which a cut inside the call keeps.
BEFORE = {"generic": "Let me see. "}


def _read(fmt: str, text: str, reason: str, piece: int = 3) -> tuple[str, list[str]]:
    """``text`` streamed in pieces of ``piece`` characters, ended for ``reason``: the
    text shown and the names of the calls read."""
    calls = ChoiceCalls(fmt)
    shown = [calls.feed(text[i : i + piece])[0] for i in range(0, len(text), piece)]
    shown.append(calls.finish(reason)[0])
    return "".join(shown), [c.name for c in calls.calls]


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_a_call_cut_anywhere_by_length_leaves_no_markup_and_no_call(fmt: str) -> None:
    whole = CALLS[fmt]
    assert _read(fmt, whole, "stop") == (BEFORE.get(fmt, ""), ["get_weather"])
    before = BEFORE.get(fmt, "")
    # Past the arguments' last brace the call is whole, closing tag or not: it counts.
    whole_at = whole.index("}}") + 2
    for cut in range(len(before) + 1, len(whole)):
        shown, calls = _read(fmt, whole[:cut], "length")
        assert calls == ([] if cut < whole_at else ["get_weather"]), (fmt, cut)
        assert shown == before, (fmt, cut, shown)


def test_a_cut_answer_that_is_no_call_keeps_its_text() -> None:
    # Text, JSON that is no call: a cut answer, given back whole.
    assert _read("generic", "The weather in Paris is", "length") == ("The weather in Paris is", [])
    assert _read("llama3", '{"city": "Par', "length") == ('{"city": "Par', [])
    # A call that ended before the cut still counts; only the cut one goes.
    first = CALLS["hermes"]
    assert _read("hermes", first + '\n<tool_call>\n{"name": "ad', "length") == ("", ["get_weather"])
    # An unfinished call that ended for another reason (the model's end token, a stop
    # string) is given back as text, as before: nothing the model wrote is lost.
    cut = CALLS["hermes"][:30]
    assert _read("hermes", cut, "stop") == (cut, [])


#: A call in each format that marks its calls with an opener of its own, after text.
OPENED = {
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "</tool_call>",
    "pythonic": '<|python_start|>[get_weather(city="Paris")]<|python_end|>',
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "command_r7b": '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
    '"parameters": {"city": "Paris"}}]<|END_ACTION|>',
}


@pytest.mark.parametrize("fmt", sorted(OPENED))
def test_a_cut_call_in_any_opened_format_leaves_the_text_before_it(fmt: str) -> None:
    before = "Let me see. "
    whole = before + OPENED[fmt]
    calls = ChoiceCalls(fmt)
    calls.feed(whole)
    calls.finish("length")
    assert [(c.name, c.arguments) for c in calls.calls] == [("get_weather", '{"city": "Paris"}')]
    for cut in range(len(before) + 1, len(whole)):
        shown, names = _read(fmt, whole[:cut], "length")
        # The text before the call, never its markup; a call only once it is whole.
        assert shown.strip() == before.strip(), (fmt, cut, shown)
        assert names in ([], ["get_weather"]), (fmt, cut)

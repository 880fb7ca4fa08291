"""Thoughts told apart from the answer in every format a template shows: whole and
streamed in any chunking (markers split anywhere), a prompt that opens the thoughts,
thoughts cut short, tool calls after them; and the switches that turn them off."""

from __future__ import annotations

import random

import pytest

from meshd.models.chat import render_chat, template_variables
from meshd.models.reasoning import (
    ReasoningParser,
    close_thoughts,
    opens_thoughts,
    reasoning_format,
    soft_switched,
    thinking_switch,
)
from meshd.models.tools import ParsedCall, ToolCallParser

# Template snippets in each family's style (written for these tests: only the
# telltales a real template of the family holds matter).
QWEN3 = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}"
    "\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
R1 = (
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% else %}<｜Assistant｜>{{ m.content.split('</think>')[-1] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
HARMONY = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}"
    "<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}<|start|>assistant"
)
TEMPLATES = {
    "think": QWEN3,
    "seed": "{{ '<seed:think>' }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "magistral": "[SYSTEM_PROMPT]Draft in [THINK]...[/THINK][/SYSTEM_PROMPT]",
    "command_r7b": "<|START_THINKING|>{{ x }}<|END_THINKING|>",
    "harmony": HARMONY,
}
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"

QUESTION = [{"role": "user", "content": "Hi?"}]


def split(fmt: str, text: str, pieces: list[int] | None = None, open: bool = False):
    """(thoughts, answer, ended) of ``text`` fed in pieces of the given sizes."""
    p = ReasoningParser(fmt, open=open)
    thoughts, answer, at = [], [], 0
    for n in pieces or [len(text)]:
        t, a = p.feed(text[at : at + n])
        thoughts.append(t)
        answer.append(a)
        at += n
    t, a = p.feed(text[at:])
    t2, a2 = p.finish()
    return "".join([*thoughts, t, t2]), "".join([*answer, a, a2]), p.ended


def chunkings(text: str, rng: random.Random) -> list[list[int]]:
    """Every one-character chunking, every two-way split, and random ones."""
    out = [[1] * len(text)] + [[i] for i in range(len(text) + 1)]
    for _ in range(30):
        sizes, left = [], len(text)
        while left:
            sizes.append(min(left, rng.randint(1, 7)))
            left -= sizes[-1]
        out.append(sizes)
    return out


@pytest.mark.parametrize(("fmt", "template"), TEMPLATES.items())
def test_the_format_is_read_from_the_template(fmt: str, template: str) -> None:
    assert reasoning_format(template) == fmt


def test_a_template_without_thoughts_has_no_format() -> None:
    assert reasoning_format(CHATML) is None
    assert reasoning_format(None) is None


CASES = [
    # (format, output, starts open, thoughts, answer)
    ("think", "<think>\nThe user greets.\n</think>\n\nHello!", False, "The user greets.", "Hello!"),
    ("think", "  <think>a < b </thi</think>ok", False, "a < b </thi", "ok"),
    ("think", "The user greets.\n</think>\n\nHello!", True, "The user greets.", "Hello!"),
    ("think", "Hello <think>x</think>", False, "", "Hello <think>x</think>"),
    ("think", "<thinker>", False, "", "<thinker>"),
    ("seed", "<seed:think>hm</seed:think>Yes", False, "hm", "Yes"),
    ("magistral", "[THINK]hm[/THINK]Yes", False, "hm", "Yes"),
    ("command_r7b", "<|START_THINKING|>hm<|END_THINKING|>Yes", False, "hm", "Yes"),
    (
        "harmony",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>final<|message|>It is sunny.<|return|>",
        False, "Need the weather.", "It is sunny.",
    ),
    ("harmony", "Plain text, no header.", False, "", "Plain text, no header."),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "output", "open", "thoughts", "answer"), CASES)
def test_thoughts_and_answer_come_apart_in_any_chunking(fmt, output, open, thoughts, answer):
    rng = random.Random(output)
    for pieces in chunkings(output, rng):
        got = split(fmt, output, pieces, open=open)
        assert got[:2] == (thoughts, answer), pieces
        assert got[2]  # the answer began


@pytest.mark.parametrize(
    ("fmt", "output", "open"),
    [("think", "<think>\nStill thinking about", False), ("think", "Still thinking", True),
     ("harmony", "<|channel|>analysis<|message|>Still thinking", False)],
)  # fmt: skip
def test_thoughts_cut_short_are_all_thoughts(fmt: str, output: str, open: bool) -> None:
    # No close marker before max_tokens: nothing of it is answer.
    for n in range(1, len(output) + 1):
        thoughts, answer, ended = split(fmt, output, [n] * (len(output) // n), open=open)
        assert answer == "" and not ended
        assert thoughts.startswith("Still thinking")


def test_the_parser_says_when_it_is_inside_the_thoughts() -> None:
    p = ReasoningParser("think")
    assert not p.thinking and not p.ended
    p.feed("<thi")
    assert not p.thinking  # held: may be the tag
    p.feed("nk>Hm")
    assert p.thinking and not p.ended
    p.feed("</think>")
    assert not p.thinking and p.ended
    assert p.feed("Yes") == ("", "Yes")


def test_a_tool_call_after_the_thoughts_is_read_from_the_answer() -> None:
    output = (
        '<think>\nThe user wants the weather: call it.\n</think>\n\n<tool_call>\n{"name": '
        '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for n in (1, 3, 1000):
        p, calls = ReasoningParser("think"), ToolCallParser("hermes")
        thoughts, parts = "", []
        for i in range(0, len(output), n):
            t, a = p.feed(output[i : i + n])
            thoughts += t
            parts += calls.feed(a)
        t, a = p.finish()
        parts += calls.feed(a) + calls.finish()
        assert thoughts == "The user wants the weather: call it."
        assert [x for x in parts if isinstance(x, ParsedCall)] == [
            ParsedCall("get_weather", '{"city": "Paris"}')
        ]


def test_a_harmony_call_after_the_analysis_reaches_the_tool_parser_whole() -> None:
    output = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|>"
    )
    for n in (1, 2, 5, 1000):
        thoughts, answer, _ = split("harmony", output, [n] * (len(output) // n))
        assert thoughts == "Need the weather."
        calls = ToolCallParser("harmony")
        parts = calls.feed(answer) + calls.finish()
        assert parts == [ParsedCall("get_weather", '{"city": "Paris"}')]


def test_an_unknown_format_from_the_wire_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning format"):
        ReasoningParser("nonsense")


def test_each_template_offers_its_own_switch() -> None:
    qwen = thinking_switch(QWEN3, template_variables(QWEN3))
    assert (qwen.variable, qwen.soft_off) == ("enable_thinking", "/no_think")
    oss = thinking_switch(HARMONY, template_variables(HARMONY))
    assert oss.effort == "reasoning_effort" and oss.variable is None
    v31 = "{% if thinking %}<think>{% else %}</think>{% endif %}"
    assert thinking_switch(v31, template_variables(v31)).variable == "thinking"
    r1 = thinking_switch(R1, template_variables(R1))
    assert r1.variable is None and r1.soft_off is None
    glm = "[gMASK]<sop>{% for m in messages %}{{ m.content }}{% endfor %}<think>"
    assert thinking_switch(glm, template_variables(glm)).soft_off == "/nothink"


def test_the_soft_switch_goes_at_the_end_of_the_last_user_turn() -> None:
    sw = thinking_switch(QWEN3, set())
    msgs = [*QUESTION, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "x"}]
    out = soft_switched(msgs, sw)
    assert out is not None and out[-1]["content"] == "x /no_think"
    assert out[0] == QUESTION[0]  # the earlier turns as they were
    assert soft_switched(msgs, thinking_switch(R1, set())) is None


def test_a_prompt_that_opens_the_thoughts_is_told_and_closed() -> None:
    prompt = render_chat(R1, QUESTION)
    assert opens_thoughts(prompt, "think")
    closed = close_thoughts(prompt, "think")
    assert closed.endswith("<think>\n\n</think>\n\n") and not opens_thoughts(closed, "think")
    assert not opens_thoughts(render_chat(QWEN3, QUESTION), "think")
    assert not opens_thoughts(render_chat(HARMONY, QUESTION), "harmony")


def test_enable_thinking_false_renders_the_empty_thoughts_in_the_prompt() -> None:
    on = render_chat(QWEN3, QUESTION, enable_thinking=True)
    off = render_chat(QWEN3, QUESTION, enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"


def test_past_thoughts_reach_a_template_that_reads_them() -> None:
    from meshd.domain.chat import ChatTurn

    turn = ChatTurn("assistant", "Hello", reasoning="The user greets.")
    assert turn.as_dict()["reasoning_content"] == "The user greets."
    shown = render_chat(QWEN3, [turn.as_dict()], add_generation_prompt=False)
    assert "<think>\nThe user greets.\n</think>\n\nHello" in shown
    # A template that does not read them drops them.
    assert "greets" not in render_chat(CHATML, [turn.as_dict()])

"""A request's thoughts through stage 0 and the last stage, in process, over a small
byte-level vocabulary: the template's switch turns them on and off, the output comes
apart into thoughts and answer with its thought tokens counted, a budget closes them
with the model's own marker, and a grammar holds only the answer after them."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np
import pytest

from meshd.domain.chat import ChatTurn, ToolSpec, ToolUse
from meshd.domain.job import Job
from meshd.domain.reasoning import ThinkChoice, Thinking
from meshd.domain.sampling import Sampling
from meshd.engines.grammar import json_schema_grammar
from meshd.engines.runner.admission import Prompts
from meshd.engines.runner.output import Ended, Output
from meshd.engines.runner.state import Request
from meshd.engines.runner.thinking import SCRIPT_ENV
from meshd.transport import wire
from tests.engines.test_tool_grammars import ByteVocab
from tests.models.test_reasoning import HARMONY, QWEN3, R1

#: The thoughts' markers (and harmony's) as control tokens of the model.
MARKERS = ["<think>", "</think>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>"]
VOCAB = ByteVocab(MARKERS)
QUESTION = [ChatTurn("user", "Hi?")]
SCHEMA = {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
    "additionalProperties": False,
}  # fmt: skip


def ids(text: str) -> list[int]:
    return VOCAB.tokenize(text, parse_special=True)


#: What stage 0 shows of a thinking request's output: its markers.
SHOWN = ids("".join(MARKERS))


def stage0(template: str, job: Job) -> tuple[str, Sampling]:
    """The prompt stage 0 renders for ``job`` (as text, control tokens shown) and the
    sampling it sends the last stage."""
    prompts = Prompts(VOCAB, template)  # type: ignore[arg-type]  # a vocabulary is all it reads
    tokens, rendered = prompts.prompt(job)
    text = b"".join(VOCAB.token_to_piece(t, special=True) for t in tokens).decode()
    return text, prompts.sampling(job, rendered, prompts.tool_grammar(job))


def test_thinking_is_on_by_default_and_told_to_the_last_stage() -> None:
    prompt, s = stage0(QWEN3, Job(messages=QUESTION))
    assert prompt.endswith("<|im_start|>assistant\n")
    assert s.thinking == Thinking(format="think", close=ids("</think>\n\n"))
    # The markers are control tokens here: the output shows them, to split by them.
    assert set(ids("<think></think>")) <= set(s.shown_specials)
    assert s.forced == []


def test_the_template_switch_turns_thinking_off() -> None:
    job = Job(messages=QUESTION, think=ThinkChoice(enabled=False))
    prompt, s = stage0(QWEN3, job)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert s.thinking is not None and not s.thinking.on
    # The client's own chat_template_kwargs say the same.
    kwargs = Job(messages=QUESTION, template_kwargs={"enable_thinking": False})
    assert stage0(QWEN3, kwargs)[0] == prompt


def test_a_prompt_that_opens_the_thoughts_starts_the_output_inside_them() -> None:
    prompt, s = stage0(R1, Job(messages=QUESTION))
    assert prompt.endswith("<think>\n") and s.thinking is not None and s.thinking.open
    # Off: R1's template has no switch, so the thoughts are closed in the prompt.
    prompt, s = stage0(R1, Job(messages=QUESTION, think=ThinkChoice(enabled=False)))
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert s.thinking is not None and not s.thinking.open and not s.thinking.on


def test_a_template_without_a_switch_gets_the_family_soft_switch() -> None:
    chatml = QWEN3.replace("enable_thinking is defined and enable_thinking is false", "false")
    prompt, s = stage0(chatml, Job(messages=QUESTION, think=ThinkChoice(enabled=False)))
    assert "Hi? /no_think<|im_end|>" in prompt
    assert s.thinking is not None and not s.thinking.on


def test_gpt_oss_effort_goes_to_its_template_and_its_answer_header_is_known() -> None:
    prompt, s = stage0(HARMONY, Job(messages=QUESTION, think=ThinkChoice(effort="high")))
    assert "Reasoning: high" in prompt
    assert s.thinking is not None and s.thinking.format == "harmony"
    assert s.thinking.close == ids("<|end|>")
    assert s.thinking.answer == ids("<|start|>assistant<|channel|>final<|message|>")
    # Off is its lowest effort: gpt-oss always thinks.
    prompt, s = stage0(HARMONY, Job(messages=QUESTION, think=ThinkChoice(enabled=False)))
    assert "Reasoning: low" in prompt and s.thinking is not None and s.thinking.on


def test_a_grammar_makes_the_model_open_its_thoughts_first() -> None:
    job = Job(messages=QUESTION, sampling=Sampling(grammar=json_schema_grammar(SCHEMA)))
    assert stage0(QWEN3, job)[1].forced == ids("<think>\n")
    assert stage0(R1, job)[1].forced == []  # the prompt opened them
    assert stage0(HARMONY, job)[1].forced == ids("<|channel|>analysis<|message|>")
    # A template with no switch may be a model's that does not think (it only strips
    # <think> from history): the grammar holds from the first token.
    plain = QWEN3.replace("enable_thinking is defined and enable_thinking is false", "false")
    s = stage0(plain, job)[1]
    assert s.forced == [] and s.thinking is not None and not s.thinking.on
    # A forced call's header follows gpt-oss's thoughts, written by its grammar.
    tools = ToolUse(tools=[ToolSpec(name="noop")], choice="required")
    s = stage0(HARMONY, msgspec.structs.replace(job, tools=tools))[1]
    assert s.thinking is not None and s.thinking.answer == ids("<|start|>assistant")


def test_stage_0_decides_the_thoughts_whatever_the_request_carried() -> None:
    forged = Sampling(thinking=Thinking(format="nonsense"), forced=[1, 2, 3])
    _, s = stage0(QWEN3, Job(prompt="plain text", sampling=forged))
    assert s.thinking is None and s.forced == []  # a plain prompt has no template


def test_client_template_variables_reach_the_template_but_not_reserved_ones() -> None:
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    kwargs = {"greeting": "Hello ", "messages": "stolen", "add_generation_prompt": 1}
    prompt, _ = stage0(template, Job(messages=QUESTION, template_kwargs=kwargs))
    assert prompt == "Hello Hi?"


def test_the_test_script_puts_its_tokens_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCRIPT_ENV, "@@")
    _, s = stage0(QWEN3, Job(messages=[ChatTurn("user", "@@<think>x</think>y")]))
    assert s.forced == ids("<think>x</think>y")
    monkeypatch.delenv(SCRIPT_ENV)
    assert stage0(QWEN3, Job(messages=[ChatTurn("user", "@@x")]))[1].forced == []


# -- the last stage ------------------------------------------------------------------


class _Links:
    def __init__(self) -> None:
        self.chunks: list[wire.DataChunk] = []

    def chunk(self, reply_to: wire.Addr, chunk: wire.DataChunk) -> None:
        self.chunks.append(chunk)


def last_stage(sampling: Sampling, favour: str, resume: list[int] | None = None) -> dict[str, Any]:
    """What the last stage sends for a request sampled greedily from logits that
    favour the bytes of ``favour`` in turn (then its last one): thoughts, answer,
    finish reason, usage."""
    links = _Links()
    out = Output(VOCAB, 1024, "", links)  # type: ignore[arg-type]  # what it reads of both
    r = Request("r", 0, [], wire.Addr("n", [], 0), sampling, n_prompt=4)
    out.init(r, list(resume or []))
    want = list(favour.encode())
    for step in range(200):
        logits = np.zeros(VOCAB.n_vocab, np.float32)
        logits[want[min(step, len(want) - 1)]] = 5.0
        got = out.sample(r, logits, 4 + step, [])
        if isinstance(got, Ended):
            assert got.chunk is not None, got.error
            links.chunks.append(got.chunk)
            break
    last = links.chunks[-1]
    return {
        "thoughts": "".join(c.reasoning for c in links.chunks),
        "answer": "".join(c.text for c in links.chunks),
        "finish": last.finish_reason,
        "usage": last.usage,
    }


THINK = Thinking(format="think", close=ids("</think>\n\n"))


def test_the_output_comes_apart_with_its_thought_tokens_counted() -> None:
    s = Sampling(temperature=0, thinking=THINK, max_tokens=40,
                 shown_specials=SHOWN)  # fmt: skip
    script = ids("<think>\nplan\n</think>\n\nHi")
    got = last_stage(msgspec.structs.replace(s, forced=script), "!")
    assert got["thoughts"] == "plan"
    assert got["answer"].startswith("Hi!")
    assert got["finish"] == "length"
    # <think>, "\n", 4 letters, "\n", </think>: its markers are thoughts' tokens.
    assert got["usage"].reasoning_tokens == 8
    assert got["usage"].completion_tokens == 40


def test_thoughts_with_no_end_before_max_tokens_are_all_thoughts() -> None:
    s = Sampling(temperature=0, thinking=msgspec.structs.replace(THINK, open=True), max_tokens=12)
    got = last_stage(s, "a")
    assert got == {**got, "thoughts": "a" * 12, "answer": "", "finish": "length"}
    assert got["usage"].reasoning_tokens == 12


def test_a_budget_closes_the_thoughts_with_the_models_own_marker() -> None:
    thinking = msgspec.structs.replace(THINK, open=True, budget=5)
    s = Sampling(temperature=0, thinking=thinking, max_tokens=20, shown_specials=SHOWN)
    got = last_stage(s, "a")
    assert got["thoughts"] == "aaaaa"
    assert got["answer"] == "a" * (20 - 5 - len(THINK.close))
    # The close marker is one of the thoughts' tokens; the blanks after it are not.
    assert got["usage"].reasoning_tokens == 5 + 1


def test_a_grammar_holds_the_answer_only_after_the_thoughts() -> None:
    # The model "wants" to write x forever: in its thoughts it may, in its answer the
    # grammar allows only JSON under the schema.
    grammar = json_schema_grammar(SCHEMA)
    s = Sampling(temperature=0, thinking=THINK, max_tokens=60, grammar=grammar,
                 forced=ids("<think>\n"), shown_specials=SHOWN)  # fmt: skip
    script = ids("<think>\nxx</think>")
    got = last_stage(msgspec.structs.replace(s, forced=script), "x")
    assert got["thoughts"] == "xx"
    assert json.loads(got["answer"]) in ({"ok": True}, {"ok": False})
    assert got["finish"] == "stop"
    # Thinking off: the grammar holds from the first token.
    off = msgspec.structs.replace(s, thinking=msgspec.structs.replace(THINK, on=False), forced=[])
    got = last_stage(off, "x")
    assert got["thoughts"] == "" and json.loads(got["answer"]) in ({"ok": True}, {"ok": False})


def test_gpt_oss_answer_header_comes_before_its_grammar() -> None:
    grammar = json_schema_grammar(SCHEMA)
    thinking = Thinking(format="harmony", close=ids("<|end|>"),
                        answer=ids("<|start|>assistant<|channel|>final<|message|>"))  # fmt: skip
    s = Sampling(temperature=0, thinking=thinking, max_tokens=80, grammar=grammar,
                 shown_specials=SHOWN,
                 forced=ids("<|channel|>analysis<|message|>hm<|end|>"))  # fmt: skip
    got = last_stage(s, "x")
    assert got["thoughts"] == "hm"
    assert json.loads(got["answer"]) in ({"ok": True}, {"ok": False})


def test_a_replay_continues_the_thoughts_where_they_were() -> None:
    thinking = msgspec.structs.replace(THINK, open=True, budget=6)
    s = Sampling(temperature=0, thinking=thinking, max_tokens=12, shown_specials=SHOWN)
    whole = last_stage(s, "abcdefghijkl")
    # (While the close marker goes in, the model's g, h and i are not taken.)
    assert whole["thoughts"] == "abcdef" and whole["answer"] == "jkl"
    # A replay after the first 3 tokens: the client has their text already; the
    # rest, the budget and the count go on as in the uninterrupted run.
    rest = last_stage(s, "defghijkl", resume=list(b"abc"))
    assert (rest["thoughts"], rest["answer"]) == ("def", "jkl")
    assert rest["usage"].reasoning_tokens == whole["usage"].reasoning_tokens

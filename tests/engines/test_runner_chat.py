"""Chat prompts and the end of a chat stream match llama-cpp-python on the default model.

llama-cpp-python renders a GGUF's template with ``bos_token``/``eos_token`` set to the
model's own token text (``Jinja2ChatFormatter``) and tokenizes the result without adding
a BOS of its own (``added_special=True``). meshd's stage 0 must give the same prompt
tokens, and its last stage the same text, stop strings included.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from meshd.domain.chat import ChatTurn
from meshd.domain.job import Job
from meshd.domain.sampling import Sampling
from meshd.engines.llama_stage import LlamaStage
from meshd.engines.runner.admission import Prompts
from meshd.engines.stage import Stage
from meshd.transport import wire

from .runners import ApiSide, RunnerProcess, runner_config, text_of

pytestmark = pytest.mark.timeout(300)

CONVERSATION = [
    ("system", "You are a terse assistant. Answer in one short sentence."),
    ("user", "What is the capital of Italy?"),
    ("assistant", "Rome."),
    ("user", "What is the capital of France?"),
]
#: A template that writes both special tokens (llama-cpp-python's Mistral template).
BOS_EOS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def llm(model_path: Path):
    """llama-cpp-python on the whole model, threads and attention as the runner's."""
    from llama_cpp import Llama

    model = Llama(
        str(model_path), n_ctx=1024, n_threads=1, n_threads_batch=1, flash_attn=False,
        verbose=False,
    )  # fmt: skip
    yield model
    model.close()


def llama_cpp_prompt_tokens(llm, template: str, messages: list[dict]) -> list[int]:
    """The prompt tokens of ``create_chat_completion``: its formatter, built as
    ``Llama.__init__`` builds it, and its tokenization of the rendered prompt."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(
        template=template,
        eos_token=llm._model.token_get_text(llm.token_eos()),
        bos_token=llm._model.token_get_text(llm.token_bos()),
        stop_token_ids=[llm.token_eos()],
    )
    result = formatter(messages=messages)
    return llm.tokenize(
        result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True
    )


@pytest.fixture(scope="module")
def stage0(model_path: Path) -> Iterator[Prompts]:
    """Stage 0's prompt rendering on the whole model, with the model's template."""
    from meshd.models.chat import chat_template_at

    stage = LlamaStage(model_path, first=True, last=True, n_ctx=1024, n_seq_max=1)
    yield Prompts(stage, chat_template_at(str(model_path)))
    stage.close()


def generate(messages: list[tuple[str, str]]) -> Job:
    """A chat job (only its messages matter to tokenization)."""
    return Job(messages=[ChatTurn(role, content) for role, content in messages])


def as_dicts(messages: list[tuple[str, str]]) -> list[dict]:
    """OpenAI message dicts."""
    return [{"role": role, "content": content} for role, content in messages]


def test_multi_turn_chat_prompt_tokens_equal_llama_cpp_python(stage0: Prompts, llm) -> None:
    template = llm.metadata["tokenizer.chat_template"]
    assert stage0.template == template
    expected = llama_cpp_prompt_tokens(llm, template, as_dicts(CONVERSATION))
    assert stage0.tokenize(generate(CONVERSATION)) == expected


def test_templates_get_the_models_bos_and_eos_text_without_a_double_bos(
    stage0: Prompts, llm
) -> None:
    conversation = CONVERSATION[1:]  # user / assistant / user
    expected = llama_cpp_prompt_tokens(llm, BOS_EOS_TEMPLATE, as_dicts(conversation))
    old, stage0.template = stage0.template, BOS_EOS_TEMPLATE
    try:
        tokens = stage0.tokenize(generate(conversation))
    finally:
        stage0.template = old
    assert tokens == expected
    assert tokens[0] == llm.token_bos() != tokens[1]
    assert llm.token_eos() in tokens  # after the assistant turn


class _RecordingStage:
    """Tokenizes nothing; records whether the runner asked for the vocabulary's BOS."""

    def __init__(self) -> None:
        self.add_special: list[bool] = []

    def special_texts(self) -> tuple[str, str]:
        return "<s>", "</s>"

    def eos_tokens(self) -> set[int]:
        return {2}

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        self.add_special.append(add_special)
        return [1]


@pytest.mark.parametrize(
    ("template", "adds_bos"),
    [
        (BOS_EOS_TEMPLATE, False),  # the template wrote the BOS: do not add another
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", True),  # vocab decides
    ],
)
def test_the_vocabularys_bos_is_added_only_when_the_template_wrote_none(
    template: str, adds_bos: bool
) -> None:
    stage = _RecordingStage()
    # A stand-in with only what Prompts reads of a stage.
    Prompts(cast(Stage, stage), template).tokenize(generate(CONVERSATION[1:]))
    # (The calls before the last look for special-token text in each message.)
    assert stage.add_special[-1] == adds_bos


# ---------------------------------------------------------------- the whole stream


@pytest.fixture(scope="module")
def runner(
    model_path: Path, slice_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunnerProcess]:
    """A real runner process holding the whole model."""
    r = RunnerProcess(runner_config(model_path, slice_dir), tmp_path_factory.mktemp("chat"))
    yield r
    r.stop()


def chat(api: ApiSide, runner: RunnerProcess, req: str, **sampling: object) -> list[wire.DataChunk]:
    """A greedy chat completion of CONVERSATION through the runner, exact (compared
    with llama-cpp-python's: no prefix an earlier request left)."""
    api.generate(
        [runner], req, messages=generate(CONVERSATION).messages,
        sampling=Sampling(temperature=0.0, max_tokens=48, **sampling),  # type: ignore[arg-type]
        exact=True,
    )  # fmt: skip
    return api.result(req)


def test_greedy_chat_equals_llama_cpp_python_and_keeps_held_text_at_eos(
    runner: RunnerProcess, api: ApiSide, llm
) -> None:
    ref = llm.create_chat_completion(as_dicts(CONVERSATION), temperature=0.0, max_tokens=48)
    ref_text = ref["choices"][0]["message"]["content"]
    assert ref["choices"][0]["finish_reason"] == "stop"  # the model ended it (EOS)
    plain = chat(api, runner, "plain")
    assert plain[0].n_prompt == ref["usage"]["prompt_tokens"]
    assert (text_of(plain), plain[-1].finish_reason) == (ref_text, "stop")

    # A stop string that the last character of the answer begins: that character is
    # held back until the next token settles it, and the next token is the EOS.
    stop = ref_text[-1] + "\u2603"
    ref_stop = llm.create_chat_completion(
        as_dicts(CONVERSATION), temperature=0.0, max_tokens=48, stop=[stop]
    )["choices"][0]["message"]["content"]
    assert ref_stop == ref_text
    held = chat(api, runner, "held", stop=[stop])
    assert (text_of(held), held[-1].finish_reason) == (ref_text, "stop")


def test_a_stop_string_ends_the_text_just_before_it(
    runner: RunnerProcess, api: ApiSide, llm
) -> None:
    ref = llm.create_chat_completion(as_dicts(CONVERSATION), temperature=0.0, max_tokens=48)
    ref_text = ref["choices"][0]["message"]["content"]
    stop = ref_text[len(ref_text) // 2 :][:3]
    ref_stop = llm.create_chat_completion(
        as_dicts(CONVERSATION), temperature=0.0, max_tokens=48, stop=[stop]
    )["choices"][0]["message"]["content"]
    cut = chat(api, runner, "cut", stop=[stop])
    assert text_of(cut) == ref_stop == ref_text[: ref_text.index(stop)]
    assert cut[-1].finish_reason == "stop"
    assert np.all([c.error is None for c in cut])

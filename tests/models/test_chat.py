"""Chat templates rendered like Hugging Face's apply_chat_template, sandboxed."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest

from meshd.models.chat import CHATML_TEMPLATE, ChatTemplateError, normalize_messages, render_chat

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smol_template(model_reader: Any) -> str:
    """The chat template stored in the default model's GGUF, read with gguf's reader."""
    return str(model_reader.fields["tokenizer.chat_template"].contents())


# ------------------------------------------------------------ the real model template


def test_smollm2_template_renders_a_system_user_assistant_conversation(
    smol_template: str,
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ]
    assert render_chat(smol_template, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_template_adds_its_own_system_prompt_when_none_is_given(
    smol_template: str,
) -> None:
    prompt = render_chat(smol_template, [{"role": "user", "content": "Hi"}])
    assert prompt == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generation_prompt_can_be_left_out(smol_template: str) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    prompt = render_chat(smol_template, messages, add_generation_prompt=False)
    assert prompt.endswith("<|im_start|>user\nU<|im_end|>\n")


def test_multipart_content_is_flattened_before_rendering(smol_template: str) -> None:
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        },
    ]
    plain = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first\nsecond"},
    ]
    assert render_chat(smol_template, parts) == render_chat(smol_template, plain)


def test_chatml_fallback_matches_smollm2_when_a_system_message_is_given(
    smol_template: str,
) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat(CHATML_TEMPLATE, messages) == render_chat(smol_template, messages)


# ---------------------------------------------------------------- message handling


def test_normalize_keeps_other_keys_and_does_not_touch_the_input() -> None:
    original = [
        {"role": "user", "content": [{"type": "text", "text": "a"}], "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    snapshot = json.dumps(original)
    out = normalize_messages(original)
    assert out == [
        {"role": "user", "content": "a", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    assert json.dumps(original) == snapshot


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"content": "no role"}], "role"),
        ([{"role": "user", "content": 3}], "content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
        ([{"role": "user", "content": [{"type": "text"}]}], "text"),
        (["not a dict"], "object"),
    ],
)
def test_malformed_messages_are_rejected_with_their_position(messages: list, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        normalize_messages(messages)
    assert "messages[0]" in str(info.value)


# ------------------------------------------------------------- template environment


def test_raise_exception_in_a_template_becomes_a_chat_template_error() -> None:
    template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render_chat(template, ok) == "ab"
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render_chat(template, [{"role": "assistant", "content": "b"}])


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}",  # does not compile
        "{{ messages[0]['content'] + 1 }}",  # type error while rendering
        "{{ ''.__class__.__mro__ }}",  # sandbox: no dunder attribute access
        "{{ messages.append(1) }}",  # immutable sandbox: no mutation
    ],
)
def test_broken_or_unsafe_templates_raise_chat_template_error(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_chat_template_error_is_a_value_error_for_the_api_layer() -> None:
    assert issubclass(ChatTemplateError, ValueError)


def test_tojson_behaves_like_transformers() -> None:
    value = {"b": "<tag> & é", "a": [1, 2]}
    assert render_chat("{{ v | tojson }}", [], v=value) == json.dumps(value, ensure_ascii=False)
    assert render_chat("{{ v | tojson(indent=2, sort_keys=true) }}", [], v=value) == json.dumps(
        value, ensure_ascii=False, indent=2, sort_keys=True
    )


def test_strftime_now_gives_the_current_date() -> None:
    assert render_chat("{{ strftime_now('%Y') }}", []) == str(datetime.now().year)


def test_special_tokens_and_extra_variables_reach_the_template() -> None:
    template = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}{{ flavour }}"
    rendered = render_chat(
        template, [{"role": "user", "content": "x"}], bos_token="<s>", eos_token="</s>", flavour="!"
    )
    assert rendered == "<s>x</s>!"


def test_tools_and_documents_default_to_none_as_in_transformers() -> None:
    template = "{% if tools is not none %}tools{% else %}none{% endif %}"
    assert render_chat(template, []) == "none"
    assert render_chat(template, [], tools=[{"type": "function"}]) == "tools"


def test_loop_controls_and_generation_blocks_are_supported() -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    )
    messages = [{"role": "user", "content": str(i)} for i in range(5)]
    assert render_chat(template, messages) == "[0][1]"


def test_trim_and_lstrip_blocks_drop_template_whitespace() -> None:
    template = (
        "{% for m in messages %}\n"
        "    {% if true %}\n"
        "{{ m['content'] }}\n"
        "    {% endif %}\n"
        "{% endfor %}"
    )
    assert render_chat(template, [{"role": "user", "content": "x"}]) == "x\n"

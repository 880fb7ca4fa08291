"""Errors worded for what a client or a person does next, against the package's cluster
(the default model split over a and b, its context 1024 tokens, asked through c).

A prompt over the context reads as OpenAI's does (clients that trim a history match on
it), with ``param`` naming the request's own field; Anthropic's and Ollama's errors
keep their shapes. A Hugging Face model no node holds points at ``meshctl pull``."""

from __future__ import annotations

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import NodeProc

pytestmark = pytest.mark.timeout(90)

LONG = "word " * 1500  # over the 1024 tokens of the test cluster's context


def _ask(via: NodeProc, path: str, body: dict) -> httpx.Response:
    return httpx.post(via.api + path, json={"model": DEFAULT_MODEL, **body}, timeout=60)


def test_a_prompt_over_the_context_reads_as_openai_words_it(via: NodeProc) -> None:
    msgs = [{"role": "user", "content": LONG}]
    asked = [
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 24}, "messages"),
        ("/v1/completions", {"prompt": LONG, "max_tokens": 24}, "prompt"),
        ("/v1/responses", {"input": LONG, "max_output_tokens": 24}, "input"),
    ]
    for path, body, param in asked:
        r = _ask(via, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"], err["type"]) == (
            "context_length_exceeded", param, "invalid_request_error"
        ), err  # fmt: skip
        n = int(err["message"].split("(")[1].split(" in the messages")[0])
        assert n > 1024 and err["message"] == (
            f"This model's maximum context length is 1024 tokens. However, you requested "
            f"{n + 24} tokens ({n} in the messages, 24 in the completion). Please reduce "
            "the length of the messages or completion."
        )
    # No completion length asked: the messages alone.
    err = _ask(via, "/v1/chat/completions", {"messages": msgs}).json()["error"]
    assert "However, your messages resulted in" in err["message"], err
    assert err["message"].endswith("Please reduce the length of the messages.")
    # The other dialects keep their own shapes.
    r = _ask(via, "/v1/messages", {"messages": msgs, "max_tokens": 24})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "maximum context length is 1024" in r.json()["error"]["message"]
    r = _ask(via, "/api/chat", {"messages": msgs, "stream": False})
    assert r.status_code == 400 and list(r.json()) == ["error"], r.text


def test_a_hugging_face_model_no_node_holds_points_at_meshctl_pull(via: NodeProc) -> None:
    name = "someorg/some-model-GGUF:Q4_K_M"
    msgs = [{"role": "user", "content": "Hi"}]
    r = _ask(via, "/v1/chat/completions", {"model": name, "messages": msgs})
    assert r.status_code == 404, r.text
    said = r.json()["error"]["message"]
    assert f"meshctl pull {name}" in said and "pip install" not in said
    r = httpx.post(via.api + "/v1/instances", json={"model": name}, timeout=60)
    assert r.status_code == 404, r.text
    said = r.json()["error"]["message"]
    assert f"meshctl pull {name}" in said and "pip install" not in said
    assert "never downloads" not in said

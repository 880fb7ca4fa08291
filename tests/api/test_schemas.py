"""Request parsing, OpenAI-shaped errors, response shapes and SSE, on a real Starlette app.

The app below is a tiny echo "model" built only from meshd.api's schemas, bodies,
errors and sse modules, served through httpx's ASGI transport (and starlette's
TestClient for the property test). When the ``openai`` package is importable, the
official client talks to the same app and must parse every answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from meshd.api.bodies import parse_body
from meshd.api.errors import (
    ApiError,
    install_error_handlers,
    model_loading,
    model_not_found,
    overloaded,
    upstream_failed,
)
from meshd.api.overflow import context_overflow
from meshd.api.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    ChatStream,
    Completion,
    CompletionRequest,
    CompletionStream,
    FieldError,
    Model,
    ModelList,
    Usage,
)
from meshd.api.sse import (
    SSE_DONE,
    SSE_HEADERS,
    SSE_KEEPALIVE,
    sse_data,
    sse_error,
    sse_response,
)

MAX_BYTES = 4096
ERROR_KEYS = {"message", "type", "param", "code"}
USER_HI = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------------------------------
# the app under test


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _raise_for_model(model: str) -> None:
    if model == "missing":
        raise model_not_found(model)
    if model == "busy":
        raise overloaded(2.5)
    if model == "loading":
        raise model_loading(model, 10)
    if model == "huge":
        raise context_overflow(5000, 4096)


async def parse_chat(request: Request) -> Response:
    req = await parse_body(request, ChatCompletionRequest, max_bytes=MAX_BYTES)
    return _json(
        {
            "request": msgspec.to_builtins(req),
            "max_new_tokens": req.max_new_tokens,
            "stop_sequences": req.stop_sequences,
            "include_usage": req.include_usage,
            "texts": [m.text for m in req.messages],
        }
    )


async def parse_completion(request: Request) -> Response:
    req = await parse_body(request, CompletionRequest, max_bytes=MAX_BYTES)
    return _json({"request": msgspec.to_builtins(req), "prompt_text": req.prompt_text})


async def chat(request: Request) -> Response:
    """Echo the last message back, character by character when streaming."""
    req = await parse_body(request, ChatCompletionRequest)
    _raise_for_model(req.model)
    text = req.messages[-1].text
    usage = Usage.of(sum(len(m.text) for m in req.messages), len(text))
    if not req.stream:
        return _json(
            ChatCompletion.single(model=req.model, content=text, finish_reason="stop", usage=usage)
        )
    s = ChatStream(req.model)

    async def events() -> AsyncIterator[bytes]:
        yield sse_data(s.start())
        yield SSE_KEEPALIVE
        for ch in text:
            yield sse_data(s.content(ch))
        if req.model == "breaks":
            yield sse_error(upstream_failed("stage 1 of llama died"))
            yield SSE_DONE
            return
        yield sse_data(s.finish("stop"))
        if req.include_usage:
            yield sse_data(s.usage(usage))
        yield SSE_DONE

    return sse_response(events())


async def completions(request: Request) -> Response:
    req = await parse_body(request, CompletionRequest)
    _raise_for_model(req.model)
    text = req.prompt_text[::-1]
    usage = Usage.of(len(req.prompt_text), len(text))
    if not req.stream:
        return _json(
            Completion.single(model=req.model, text=text, finish_reason="length", usage=usage)
        )
    s = CompletionStream(req.model)

    async def events() -> AsyncIterator[bytes]:
        for ch in text:
            yield sse_data(s.content(ch))
        yield sse_data(s.finish("length"))
        if req.include_usage:
            yield sse_data(s.usage(usage))
        yield SSE_DONE

    return sse_response(events())


async def models(request: Request) -> Response:
    return _json(ModelList(data=[Model(id="llama", created=1_700_000_000)]))


async def boom(request: Request) -> Response:
    raise RuntimeError("secret-internal-detail at /home/me/weights")


def make_app() -> Starlette:
    app = Starlette(
        routes=[
            Route("/parse/chat", parse_chat, methods=["POST"]),
            Route("/parse/completion", parse_completion, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/boom", boom, methods=["GET"]),
        ]
    )
    install_error_handlers(app)
    return app


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app())
    # JSON by default, as every client of the API sends it (a test may say otherwise).
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://testserver", headers=headers
    ) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int, **expect: Any) -> dict[str, Any]:
    """``r`` is an error in OpenAI's shape with ``status``; returns the error object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == ERROR_KEYS
    assert isinstance(err["message"], str) and err["message"]
    for key, value in expect.items():
        assert err[key] == value, (key, err)
    return err


def chat_body(**over: Any) -> dict[str, Any]:
    return {"model": "llama", "messages": USER_HI, **over}


# ---------------------------------------------------------------------------------------
# parsing: what is accepted


async def test_a_valid_chat_request_arrives_typed_with_derived_values(
    client: httpx.AsyncClient,
) -> None:
    body = chat_body(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "tool_calls": []},
        ],
        max_completion_tokens=7,
        stop="END",
        stream=True,
        stream_options={"include_usage": True},
        top_k=40,
        seed=-3,
    )
    r = await client.post("/parse/chat", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["max_new_tokens"] == 7
    assert out["stop_sequences"] == ["END"]
    assert out["include_usage"] is True
    assert out["texts"] == ["be brief", "a\nb", ""]
    assert out["request"]["top_k"] == 40 and out["request"]["seed"] == -3


async def test_unknown_fields_are_ignored_at_every_level(client: httpx.AsyncClient) -> None:
    body = chat_body(
        messages=[{"role": "user", "content": "hi", "future_field": {"x": 1}}],
        stream_options={"include_usage": False, "include_obfuscation": True},
        user="alice",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        tool_choice="auto",
        parallel_tool_calls=True,
        reasoning_effort="low",
        brand_new_openai_param=[1, 2, 3],
    )
    r = await client.post("/parse/chat", json=body)
    assert r.status_code == 200, r.text
    assert "user" not in r.json()["request"]


@pytest.mark.parametrize(
    "over",
    [
        {"n": 1},
        {"n": None},
        {"logprobs": False},
        {"logprobs": True, "top_logprobs": 20},
        {"logit_bias": {}},
        {"tools": []},
        {"functions": []},
        {"response_format": {"type": "text"}},
        {"presence_penalty": 1.5, "frequency_penalty": -2},
        {"logit_bias": {"50256": -100, "7": 100, "0": 0.5}},
        {"min_p": 0.1, "repeat_penalty": 1.1, "repeat_last_n": -1},
        {"temperature": 0, "top_p": 1},
        {"temperature": 2},
        {"max_tokens": 5, "max_completion_tokens": 5},
        {"stop": ["a", "b", "c", "d"]},
        {"stop": None, "stream": None, "seed": None},
        {"stream_options": {"include_usage": True}},  # without stream: tolerated
    ],
)
async def test_neutral_or_supported_values_are_accepted(
    client: httpx.AsyncClient, over: dict[str, Any]
) -> None:
    r = await client.post("/parse/chat", json=chat_body(**over))
    assert r.status_code == 200, r.text


async def test_max_tokens_alone_sets_max_new_tokens(client: httpx.AsyncClient) -> None:
    r = await client.post("/parse/chat", json=chat_body(max_tokens=9))
    assert r.json()["max_new_tokens"] == 9
    r = await client.post("/parse/chat", json=chat_body())
    assert r.json()["max_new_tokens"] is None
    assert r.json()["include_usage"] is False


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", "application/vnd.api+json"],
)
async def test_json_content_types_are_accepted(
    client: httpx.AsyncClient, content_type: str
) -> None:
    headers = {"content-type": content_type}
    r = await client.post("/parse/chat", content=json.dumps(chat_body()).encode(), headers=headers)
    assert r.status_code == 200, r.text


async def test_a_completion_prompt_may_be_a_list_of_one(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/parse/completion", json={"model": "llama", "prompt": ["once upon"], "echo": False}
    )
    assert r.status_code == 200, r.text
    assert r.json()["prompt_text"] == "once upon"


# ---------------------------------------------------------------------------------------
# parsing: what is refused, and how


async def test_invalid_json_is_a_400_invalid_json(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/parse/chat", content=b'{"model": "llama",', headers={"content-type": "application/json"}
    )
    err = assert_openai_error(r, 400, type="invalid_request_error", code="invalid_json")
    assert "not valid JSON" in err["message"]


async def test_invalid_utf8_is_a_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/parse/chat", content=b'{"model": "\xff\xfe"}')
    assert_openai_error(r, 400, code="invalid_json")


@pytest.mark.parametrize("body", [b"[]", b"42", b'"text"', b"null", b"true"])
async def test_non_object_json_is_a_400(client: httpx.AsyncClient, body: bytes) -> None:
    r = await client.post("/parse/chat", content=body)
    err = assert_openai_error(r, 400, param=None)
    assert "must be a JSON object" in err["message"]


@pytest.mark.parametrize("body", [b"", b"   \n"])
async def test_an_empty_body_is_a_400(client: httpx.AsyncClient, body: bytes) -> None:
    r = await client.post("/parse/chat", content=body)
    err = assert_openai_error(r, 400)
    assert "empty" in err["message"]


async def test_json_nested_too_deep_is_a_400(client: httpx.AsyncClient) -> None:
    deep = b'{"model": "m", "messages": [], "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    r = await client.post("/parse/chat", content=deep)
    assert_openai_error(r, 400)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (chat_body(model=5), "model", "Expected `str`, got `int` - at `$.model`"),
        (
            chat_body(messages=[{"role": "robot", "content": "x"}]),
            "messages[0].role",
            "`$.messages[0].role`",
        ),
        (
            chat_body(messages=[{"role": "user", "content": 7}]),
            "messages[0].content",
            "`$.messages[0].content`",
        ),
        (chat_body(temperature="hot"), "temperature", "`$.temperature`"),
        (chat_body(max_tokens=1.5), "max_tokens", "got `float` - at `$.max_tokens`"),
        (chat_body(stream="yes"), "stream", "`$.stream`"),
        (chat_body(stop=[1]), "stop[0]", "`$.stop[0]`"),
        (chat_body(stream_options=True), "stream_options", "`$.stream_options`"),
        (chat_body(messages="hi"), "messages", "`$.messages`"),
    ],
)
async def test_a_wrongly_typed_field_is_named_by_its_path(
    client: httpx.AsyncClient, body: dict[str, Any], param: str, needle: str
) -> None:
    r = await client.post("/parse/chat", json=body)
    err = assert_openai_error(r, 400, type="invalid_request_error", param=param)
    assert needle in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER_HI}, "model"),
        ({"model": "llama"}, "messages"),
        ({"model": "llama", "messages": [{"content": "hi"}]}, "messages[0].role"),
    ],
)
async def test_a_missing_field_is_named(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    r = await client.post("/parse/chat", json=body)
    err = assert_openai_error(r, 400, param=param)
    assert "missing required field" in err["message"]
    assert f"`$.{param}`" in err["message"]


async def test_n_over_the_choice_limit_is_rejected(client: httpx.AsyncClient) -> None:
    assert (await client.post("/parse/chat", json=chat_body(n=8))).status_code == 200
    r = await client.post("/parse/chat", json=chat_body(n=9))
    err = assert_openai_error(r, 400, param="n")
    assert "n must be in [1, 8]" in err["message"]


@pytest.mark.parametrize(
    ("over", "param", "code"),
    [
        ({"temperature": 2.5}, "temperature", None),
        ({"temperature": -0.1}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"top_p": 1.01}, "top_p", None),
        ({"top_k": -1}, "top_k", None),
        ({"max_tokens": 0}, "max_tokens", None),
        ({"max_completion_tokens": 0}, "max_completion_tokens", None),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({"stop": ""}, "stop", None),
        ({"seed": 2**63}, "seed", None),
        ({"model": ""}, "model", None),
        ({"messages": []}, "messages", None),
        ({"messages": [{"role": "user"}]}, "messages[0].content", None),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", None),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].image_url.url",
            None,
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
            "unsupported_parameter",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
            None,
        ),
        ({"presence_penalty": 2.5}, "presence_penalty", None),
        ({"frequency_penalty": -3}, "frequency_penalty", None),
        ({"n": 0}, "n", None),
        ({"top_logprobs": 3}, "top_logprobs", None),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
        ({"logit_bias": {"50256": -101}}, "logit_bias", None),
        ({"logit_bias": {"the": 1}}, "logit_bias", None),
        ({"logit_bias": {"-1": 1}}, "logit_bias", None),
        ({"min_p": 1.5}, "min_p", None),
        ({"repeat_penalty": 0}, "repeat_penalty", None),
        ({"repeat_last_n": -2}, "repeat_last_n", None),
        ({"tools": [{"type": "function"}]}, "tools[0].function", None),
        (
            {"tools": [{"type": "code", "function": {"name": "f"}}]},
            "tools[0].type",
            "unsupported_parameter",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "unsupported_parameter"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
            "response_format.json_schema.schema",
            "invalid_json_schema",
        ),
    ],
)
async def test_a_rule_broken_is_a_400_naming_the_field(
    client: httpx.AsyncClient, over: dict[str, Any], param: str, code: str | None
) -> None:
    r = await client.post("/parse/chat", json=chat_body(**over))
    err = assert_openai_error(r, 400, type="invalid_request_error", param=param, code=code)
    assert f"`$.{param}`" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "llama", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "llama", "prompt": []}, "prompt"),
        ({"model": "llama", "prompt": [1, 2, 3]}, "prompt[0]"),
        ({"model": "llama", "prompt": "x", "echo": True}, "echo"),
        ({"model": "llama", "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": "llama", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "llama", "prompt": "x", "suffix": "tail"}, "suffix"),
        ({"model": "llama", "prompt": "x", "n": 9}, "n"),
        ({"model": "llama", "prompt": "x", "temperature": 9}, "temperature"),
        ({"model": "llama"}, "prompt"),
    ],
)
async def test_completion_rules(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    r = await client.post("/parse/completion", json=body)
    assert_openai_error(r, 400, param=param)


@pytest.mark.parametrize(
    "content_type",
    [
        "multipart/form-data; boundary=x",
        "text/plain",
        "application/x-www-form-urlencoded",  # what a cross-site form sends, no preflight
        None,  # a typeless blob, likewise
    ],
)
async def test_a_body_not_declared_json_is_a_415(
    client: httpx.AsyncClient, content_type: str | None
) -> None:
    body = json.dumps(chat_body()).encode()
    if content_type is None:
        transport = httpx.ASGITransport(app=make_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as bare:
            r = await bare.post("/parse/chat", content=body)
    else:
        r = await client.post("/parse/chat", content=body, headers={"content-type": content_type})
    err = assert_openai_error(r, 415, code="unsupported_media_type")
    assert "application/json" in err["message"]


# ---------------------------------------------------------------------------------------
# size limit


def _big_body() -> bytes:
    return json.dumps(chat_body(messages=[{"role": "user", "content": "x" * MAX_BYTES}])).encode()


async def test_a_body_over_the_limit_by_content_length_is_a_413(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/parse/chat", content=_big_body())
    assert_openai_error(r, 413, code="request_too_large")


async def test_a_streamed_body_without_content_length_is_cut_at_the_limit(
    client: httpx.AsyncClient,
) -> None:
    body = _big_body()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    r = await client.post("/parse/chat", content=chunks())
    assert r.request.headers.get("content-length") is None
    assert_openai_error(r, 413, code="request_too_large")


async def test_a_body_longer_than_its_declared_length_is_still_cut() -> None:
    app = make_app()
    body = _big_body()
    incoming = [
        {"type": "http.request", "body": body[:3000], "more_body": True},
        {"type": "http.request", "body": body[3000:], "more_body": False},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/parse/chat",
        "raw_path": b"/parse/chat",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }
    await app(scope, receive, send)
    assert sent[0]["status"] == 413
    body_out = b"".join(m.get("body", b"") for m in sent[1:])
    assert json.loads(body_out)["error"]["code"] == "request_too_large"


async def test_a_garbage_content_length_is_a_400() -> None:
    # httpx will not send a malformed header, so talk ASGI directly.
    app = make_app()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/parse/chat",
        "raw_path": b"/parse/chat",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"lots")],
    }
    await app(scope, receive, send)
    assert sent[0]["status"] == 400


# ---------------------------------------------------------------------------------------
# error handlers


async def test_an_unknown_route_is_a_404_in_openai_shape(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/nope")
    err = assert_openai_error(r, 404, type="not_found_error")
    assert "/v1/nope" in err["message"]


async def test_a_wrong_method_is_a_405_in_openai_shape(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/chat/completions")
    assert_openai_error(r, 405, type="invalid_request_error", code="method_not_allowed")
    assert r.headers["allow"] == "POST"


async def test_an_unexpected_exception_is_an_opaque_logged_500(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="meshd.api"):
        r = await client.get("/boom")
    err = assert_openai_error(r, 500, type="server_error")
    assert "secret" not in r.text and "weights" not in r.text
    assert "RuntimeError" not in err["message"]
    logged = [rec for rec in caplog.records if rec.name == "meshd.api"]
    assert len(logged) == 1
    assert "GET /boom" in logged[0].getMessage()
    assert logged[0].exc_info is not None


@pytest.mark.parametrize(
    ("model", "status", "typ", "code", "retry_after"),
    [
        ("missing", 404, "not_found_error", "model_not_found", None),
        ("busy", 429, "rate_limit_error", "overloaded", "3"),
        ("loading", 503, "service_unavailable", "model_loading", "10"),
        ("huge", 400, "invalid_request_error", "context_length_exceeded", None),
    ],
)
async def test_api_errors_carry_status_type_code_and_retry_after(
    client: httpx.AsyncClient,
    model: str,
    status: int,
    typ: str,
    code: str,
    retry_after: str | None,
) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body(model=model))
    assert_openai_error(r, status, type=typ, code=code)
    assert r.headers.get("retry-after") == retry_after


def test_context_overflow_reads_like_openai() -> None:
    err = context_overflow(5000, 4096)
    assert err.message.startswith(
        "This model's maximum context length is 4096 tokens. "
        "However, your messages resulted in 5000 tokens."
    )
    err = context_overflow(4000, 4096, n_completion=1000)
    assert "you requested 5000 tokens (4000 in the messages, 1000 in the completion)" in (
        err.message
    )
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")


def test_error_factories() -> None:
    e = upstream_failed("rank 2 of llama timed out")
    assert (e.status, e.type, e.code) == (502, "server_error", "upstream_failed")
    e = model_not_found("gpt-9")
    assert (e.status, e.type, e.code, e.param) == (
        404,
        "not_found_error",
        "model_not_found",
        "model",
    )
    assert "`gpt-9`" in e.message
    assert overloaded(0.2).headers() == {"Retry-After": "1"}
    assert ApiError(400, "x").headers() == {}
    assert json.loads(e.to_response().body) == {
        "error": {
            "message": e.message,
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_field_errors_also_guard_construction_in_python() -> None:
    with pytest.raises(FieldError) as info:
        ChatCompletionRequest(model="m", messages=[], temperature=1)
    assert info.value.param == "messages"


# ---------------------------------------------------------------------------------------
# response shapes (pinned as literal dicts: what the openai client reads)


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def _enc(obj: Any) -> Any:
    return json.loads(msgspec.json.encode(obj))


def test_chat_completion_shape() -> None:
    out = ChatCompletion.single(
        model="llama",
        content="Hi",
        finish_reason="stop",
        usage=Usage.of(3, 2),
        id="chatcmpl-1",
        created=1700000000,
    )
    assert _enc(out) == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "llama",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }


def test_chat_chunk_shapes_including_the_usage_only_chunk() -> None:
    s = ChatStream("llama", id="chatcmpl-2", created=1700000001)
    head = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1700000001}
    head["model"] = "llama"

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    assert _enc(s.start()) == {
        **head,
        "choices": [choice({"role": "assistant", "content": ""})],
        "usage": None,
    }
    assert _enc(s.content("Hi")) == {**head, "choices": [choice({"content": "Hi"})], "usage": None}
    assert _enc(s.finish("length")) == {**head, "choices": [choice({}, "length")], "usage": None}
    assert _enc(s.usage(Usage.of(3, 2))) == {**head, "choices": [], "usage": USAGE}


def test_completion_and_completion_chunk_shapes() -> None:
    out = Completion.single(
        model="llama",
        text="ok",
        finish_reason="length",
        usage=Usage.of(3, 2),
        id="cmpl-1",
        created=1700000002,
    )
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1700000002, "model": "llama"}
    assert _enc(out) == {
        **head,
        "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
        "usage": USAGE,
    }
    s = CompletionStream("llama", id="cmpl-1", created=1700000002)
    assert _enc(s.content("o")) == {
        **head,
        "choices": [{"index": 0, "text": "o", "logprobs": None, "finish_reason": None}],
        "usage": None,
    }
    assert _enc(s.finish("stop"))["choices"][0]["finish_reason"] == "stop"
    assert _enc(s.usage(Usage.of(3, 2))) == {**head, "choices": [], "usage": USAGE}


def test_model_list_shape() -> None:
    assert _enc(ModelList(data=[Model(id="llama", created=1700000003)])) == {
        "object": "list",
        "data": [{"id": "llama", "object": "model", "created": 1700000003, "owned_by": "meshd"}],
    }


def test_ids_have_openai_prefixes_and_stream_chunks_share_them() -> None:
    a = ChatStream("m")
    assert a.id.startswith("chatcmpl-") and a.start().id == a.content("x").id == a.id
    assert CompletionStream("m").id.startswith("cmpl-")
    assert (
        ChatCompletion.single(model="m", content="", finish_reason="stop", usage=Usage.of(0, 0)).id
        != ChatCompletion.single(
            model="m", content="", finish_reason="stop", usage=Usage.of(0, 0)
        ).id
    )
    assert isinstance(Model(id="x").created, int)


# ---------------------------------------------------------------------------------------
# SSE


def test_sse_framing() -> None:
    assert sse_data({"a": "line1\nline2"}) == b'data: {"a":"line1\\nline2"}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"
    event = sse_error(upstream_failed("boom"))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: ") :]) == {
        "error": {
            "message": "boom",
            "type": "server_error",
            "param": None,
            "code": "upstream_failed",
        }
    }
    assert dict(SSE_HEADERS) == {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _events(raw: str) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.split("\n\n") if e.startswith("data: ")]


async def test_a_chat_stream_is_sse_and_ends_with_usage_then_done(
    client: httpx.AsyncClient,
) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["x-accel-buffering"] == "no"
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "hi"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


async def test_a_failure_mid_stream_is_an_error_event(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body(model="breaks", stream=True))
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "upstream_failed"


# ---------------------------------------------------------------------------------------
# property: no body makes the parser answer 5xx


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=20)
)
_json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
_part = st.fixed_dictionaries(
    {},
    optional={"type": st.sampled_from(["text", "image_url"]) | _json_values, "text": _json_values},
)
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "x"]),
        "content": st.text(max_size=10) | st.lists(_part, max_size=3) | _json_values,
        "name": _json_values,
    },
)
_knobs = {
    name: _json_values | st.floats(min_value=-3, max_value=3) | st.integers(-2, 5)
    for name in (
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "repeat_penalty",
        "repeat_last_n",
        "best_of",
        "logprobs",
        "top_logprobs",
        "echo",
    )
}
_request_like = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=8) | _json_values,
        "messages": st.lists(_message, max_size=3) | _json_values,
        "prompt": st.text(max_size=8) | st.lists(st.text(max_size=4), max_size=2) | _json_values,
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6) | _json_values,
        "stream": _json_values,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": _json_values})
        | _json_values,
        "logit_bias": st.dictionaries(
            st.text(max_size=4) | st.integers(-3, 70000).map(str), _json_values, max_size=3
        )
        | _json_values,
        "tools": _json_values,
        "response_format": st.fixed_dictionaries({}, optional={"type": _json_values})
        | _json_values,
        **_knobs,
    },
)


def _to_bytes(value: Any) -> bytes:
    # json.dumps writes NaN/Infinity and lone surrogates: invalid JSON the parser must
    # refuse with a 400, which is part of the point.
    return json.dumps(value).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def sync_client() -> Iterator[TestClient]:
    with TestClient(
        make_app(), raise_server_exceptions=True, headers={"content-type": "application/json"}
    ) as c:
        yield c


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(["/parse/chat", "/parse/completion"]),
    body=st.one_of(
        _request_like.map(_to_bytes),
        _json_values.map(_to_bytes),
        st.binary(max_size=64),
    ),
)
def test_no_request_body_makes_the_parser_answer_5xx(
    sync_client: TestClient, path: str, body: bytes
) -> None:
    r = sync_client.post(path, content=body)
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        body_out = r.json()
        assert set(body_out) == {"error"} and set(body_out["error"]) == ERROR_KEYS


# ---------------------------------------------------------------------------------------
# the official openai client, when installed


def _openai_client() -> Any:
    openai = pytest.importorskip(
        "openai",
        reason="the openai package is not installed; the JSON shapes it reads are pinned "
        "by the literal-dict tests above",
    )
    transport = httpx.ASGITransport(app=make_app())
    return openai, openai.AsyncOpenAI(
        base_url="http://testserver/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport, base_url="http://testserver"),
    )


async def test_openai_client_parses_chat_completions_and_streams() -> None:
    openai, oa = _openai_client()
    async with oa:
        out = await oa.chat.completions.create(model="llama", messages=USER_HI, max_tokens=4)
        assert out.choices[0].message.content == "hi"
        assert out.choices[0].finish_reason == "stop"
        assert out.usage is not None and out.usage.total_tokens == 4

        stream = await oa.chat.completions.create(
            model="llama", messages=USER_HI, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hi"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2

        with pytest.raises(openai.APIError, match="stage 1 of llama died"):
            stream = await oa.chat.completions.create(model="breaks", messages=USER_HI, stream=True)
            async for _ in stream:
                pass


async def test_openai_client_parses_completions_and_models() -> None:
    _openai, oa = _openai_client()
    async with oa:
        out = await oa.completions.create(model="llama", prompt="abc")
        assert out.choices[0].text == "cba" and out.choices[0].finish_reason == "length"
        stream = await oa.completions.create(model="llama", prompt="abc", stream=True)
        assert "".join([c.choices[0].text async for c in stream if c.choices]) == "cba"
        models = await oa.models.list()
        assert [(m.id, m.owned_by, m.object) for m in models.data] == [("llama", "meshd", "model")]


async def test_openai_client_maps_our_errors_to_its_exceptions() -> None:
    openai, oa = _openai_client()
    async with oa:
        with pytest.raises(openai.BadRequestError) as bad:
            await oa.chat.completions.create(model="llama", messages=USER_HI, n=9)
        assert bad.value.param == "n"
        with pytest.raises(openai.NotFoundError) as nf:
            await oa.chat.completions.create(model="missing", messages=USER_HI)
        assert nf.value.code == "model_not_found"
        with pytest.raises(openai.RateLimitError):
            await oa.chat.completions.create(model="busy", messages=USER_HI)
        with pytest.raises(openai.BadRequestError) as big:
            await oa.chat.completions.create(model="huge", messages=USER_HI)
        assert big.value.code == "context_length_exceeded"


def test_openai_types_validate_our_responses_strictly() -> None:
    """Stricter than the client (which parses leniently): pydantic validation passes."""
    pytest.importorskip("openai", reason="the openai package is not installed")
    from openai.types import Completion as OaCompletion
    from openai.types import Model as OaModel
    from openai.types.chat import ChatCompletion as OaChatCompletion
    from openai.types.chat import ChatCompletionChunk as OaChatCompletionChunk

    usage = Usage.of(3, 2)
    OaChatCompletion.model_validate(
        _enc(ChatCompletion.single(model="m", content="x", finish_reason="stop", usage=usage))
    )
    s = ChatStream("m")
    for chunk in (s.start(), s.content("x"), s.finish("length"), s.usage(usage)):
        OaChatCompletionChunk.model_validate(_enc(chunk))
    OaCompletion.model_validate(
        _enc(Completion.single(model="m", text="x", finish_reason="stop", usage=usage))
    )
    # OpenAI's Completion type has a non-optional finish_reason, yet its own streams
    # send null until the last chunk (the client parses leniently); check the last one.
    cs = CompletionStream("m")
    for chunk in (cs.finish("stop"), cs.usage(usage)):
        OaCompletion.model_validate(_enc(chunk))
    for m in ModelList(data=[Model(id="a")]).data:
        OaModel.model_validate(_enc(m))

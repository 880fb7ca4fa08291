"""Random requests at every route of the HTTP API: no 5xx, 4xx in the shape of the
route's dialect (OpenAI, Anthropic, Ollama), no change.

The routes are read from :data:`meshd.api.app.ROUTES`, so a new route is fuzzed
without touching this file. Every request is sent to node ``a`` (which serves the
default model); a body that a correct node would act on (a valid completion or
placement for a model this machine can resolve) is not sent, so the cluster state
must be exactly what it was afterwards.
"""

from __future__ import annotations

import json
import math
import socket
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.routing import Route

from meshd.api import anthropic_schemas, ollama_schemas, responses_schemas, schemas
from meshd.api.app import ROUTES as API_ROUTES
from meshd.api.auth import ADMIN_HEADER
from meshd.api.errors import dialect_of
from meshd.api.instances import PlaceRequest
from meshd.models.resolve import AmbiguousModelError, ModelNotFoundError, resolve_model
from tests.cluster import ADMIN_KEY

from .harness import FIGURES, Env, completion, fuzz_settings, stable_state

pytestmark = pytest.mark.timeout(90)

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD", "TRACE", "FUZZ"]
JSON_TYPES = ["application/json", "application/json; charset=utf-8", "text/json",
              "application/vnd.api+json"]  # fmt: skip
OTHER_TYPES = [None, "application/x-www-form-urlencoded", "text/plain",
               "multipart/form-data; boundary=x", "application/xml",
               "application/octet-stream", "", "json", ";;;", "application/json\x7f"]  # fmt: skip
#: What each POST route decodes its body into (routes not listed take no body).
BODY_TYPES: dict[str, type] = {
    "/v1/chat/completions": schemas.ChatCompletionRequest,
    "/v1/completions": schemas.CompletionRequest,
    "/v1/instances": PlaceRequest,
    "/v1/responses": responses_schemas.ResponseRequest,
    "/v1/messages": anthropic_schemas.MessagesRequest,
    "/v1/messages/count_tokens": anthropic_schemas.CountTokensRequest,
    "/api/chat": ollama_schemas.ChatRequest,
    "/api/generate": ollama_schemas.GenerateRequest,
    "/api/embed": ollama_schemas.EmbedRequest,
    "/api/embeddings": ollama_schemas.EmbeddingsRequest,
    "/api/show": ollama_schemas.ModelRequest,
    "/api/pull": ollama_schemas.ModelRequest,
    "/api/delete": ollama_schemas.ModelRequest,
}


# The OpenAI routes some clients reach under /api/v1 decode the same bodies.
BODY_TYPES |= {"/api" + p: t for p, t in list(BODY_TYPES.items()) if p.startswith("/v1/")
               and p not in ("/v1/instances",) and not p.startswith("/v1/messages")}  # fmt: skip


def routes() -> dict[str, set[str]]:
    """Path template -> allowed methods, from the app's own route table."""
    out: dict[str, set[str]] = {}
    for r in API_ROUTES:
        if isinstance(r, Route):
            out.setdefault(r.path, set()).update(r.methods or ())
    return out


ROUTES = routes()


def methods_at(path: str) -> set[str]:
    """Every method some route serves at ``path``: a literal route's path may also fill
    a parameter of another (``/v1/instances/stream`` is ``/v1/instances/{id}`` too)."""
    out: set[str] = set()
    for r in API_ROUTES:
        if isinstance(r, Route) and r.path_regex.match(path):
            out.update(r.methods or ())
    return out


# -- strategies ------------------------------------------------------------------------
#: Strings JSON and UTF-8 make hard: lone surrogates, NUL, BOM, escapes, RTL marks.
_nasty = st.sampled_from(
    ["\ud800", "a\udfffb", "\x00", "\ufeff", "\\u0000", "\u202e", "\U0010ffff"]
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | _nasty,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=5),
    max_leaves=12,
)
_ids = st.text(max_size=40) | st.sampled_from(["..", ".", "%00", "a/b", " ", "x" * 300])


def _fill(path: str, ident: str) -> str:
    # Dots escaped too: a client would resolve "/v1/instances/.." to "/v1".
    quoted = urllib.parse.quote(ident, safe="").replace(".", "%2E")
    return path.replace("{instance_id}", quoted)


def _valid_base(path: str) -> dict[str, Any]:
    path = path.removeprefix("/api") if path.startswith("/api/v1/") else path
    if path == "/v1/chat/completions":
        return {"model": "fuzz-no-such-model", "messages": [{"role": "user", "content": "x"}]}
    if path == "/v1/completions":
        return {"model": "fuzz-no-such-model", "prompt": "x"}
    if path == "/v1/responses":
        return {"model": "fuzz-no-such-model", "input": "x"}
    if path.startswith("/v1/messages"):
        return {"model": "fuzz-no-such-model", "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
    if path == "/api/chat":
        return {"model": "fuzz-no-such-model", "messages": [{"role": "user", "content": "x"}]}
    if path == "/api/generate":
        return {"model": "fuzz-no-such-model", "prompt": "x"}
    return {"model": "fuzz-no-such-model"}


@st.composite
def bodies(draw, path: str) -> tuple[bytes | None, str | None]:
    """A body and its Content-Type header (None: no body / no header)."""
    kind = draw(st.sampled_from(
        ["none", "empty", "json", "json", "object", "object", "bytes", "bad_utf8", "nan",
         "whitespace"]
    ))  # fmt: skip
    ctype = draw(st.sampled_from(JSON_TYPES) | st.sampled_from(OTHER_TYPES) | st.text(max_size=20))
    if kind == "none":
        return None, draw(st.sampled_from([None, *JSON_TYPES]))
    if kind == "empty":
        return b"", ctype
    if kind == "json":
        return json.dumps(draw(_json)).encode(), ctype
    if kind == "object":
        # A plausible body with random fields replaced or added (often valid JSON of the
        # wrong shape: wrong types, unknown fields, huge or negative numbers).
        body = _valid_base(path)
        for k, v in draw(st.dictionaries(
            st.sampled_from(["model", "messages", "prompt", "max_tokens", "temperature",
                             "top_p", "top_k", "seed", "stop", "stream", "n", "nodes",
                             "engines", "min_nodes", "stream_options", "logit_bias"])
            | st.text(max_size=10),
            _json | st.integers(-(2**80), 2**80) | st.text(min_size=1000, max_size=3000),
            max_size=4,
        )).items():  # fmt: skip
            body[k] = v
        ascii_only = draw(st.booleans())
        return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"), ctype
    if kind == "bytes":
        return draw(st.binary(max_size=200)), ctype
    if kind == "bad_utf8":
        head = json.dumps(_valid_base(path))[:-1].encode()
        return head + b', "x": "' + draw(st.binary(min_size=1, max_size=8)) + b'\xff"}', ctype
    if kind == "nan":
        return json.dumps({**_valid_base(path), "temperature": math.nan}).encode(), ctype
    return draw(st.sampled_from([b" ", b"\n\t ", b"\x00"])), ctype


@st.composite
def requests(draw) -> tuple[str, str, str, set[str], bytes | None, str | None, dict]:
    """(method, template, path, methods the route allows, body, content type, query) for any
    route, or none. The allowed methods are unknown (empty) when the path parameter
    makes it another route: empty, or holding a "/" (the server decodes %2F first)."""
    template = draw(st.sampled_from(sorted(ROUTES)) | st.sampled_from(["/v1/fuzz", "/", "/v2"]))
    allowed = ROUTES.get(template, set())
    method = draw(st.sampled_from(sorted(allowed) or METHODS) | st.sampled_from(METHODS))
    ident = draw(_ids)
    path = _fill(template, ident)
    if "{" in template and (not ident or "/" in ident):
        allowed = set()
    elif allowed:
        allowed = methods_at(path)
    body, ctype = draw(bodies(template))
    query = draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2))
    return method, template, path, allowed, body, ctype, query


# -- oracle ------------------------------------------------------------------------------
class _Skip(Exception):
    """Not sent: a correct node would act on it, or it trips an open bug."""


def _screen_model(model: str) -> None:
    """Raise _Skip if the server could resolve ``model`` (it would place or run it)."""
    try:
        resolve_model(model)
    except (ModelNotFoundError, AmbiguousModelError, ValueError):
        return
    except OSError:
        return  # the server answers whatever it answers (this once was a 500)
    FIGURES.skipped_frames += 1
    raise _Skip(f"{model!r} resolves on this machine")


#: Routes whose GET is an event stream that never ends.
_ENDLESS = frozenset({"/v1/instances/stream", "/v1/cluster/stream"})


def _screen(method: str, template: str, path: str, body: bytes | None, env: Env) -> None:
    if method == "DELETE" and path.rstrip("/").endswith("/" + env.instance):
        raise _Skip("a real delete")
    if method == "GET" and template in _ENDLESS:
        # Endless event streams by design (tests/api/test_instance_stream.py and
        # tests/ui/test_stream.py read them): a GET would wait forever.
        raise _Skip("an endless stream")
    typ = BODY_TYPES.get(template)
    if method not in ("POST", "DELETE") or typ is None or body is None:
        return
    try:
        decoded = msgspec.json.decode(body, type=typ)
    except Exception:
        return  # the server refuses it too
    model = getattr(decoded, "model_name", None) or decoded.model
    _screen_model(model)
    if model.endswith(":latest"):  # Ollama's tag: the bare name is what resolves
        _screen_model(model.removesuffix(":latest"))


# -- checks --------------------------------------------------------------------------------
def _check_response(r: httpx.Response, method: str, allowed: set[str]) -> None:
    FIGURES.api_cases += 1
    FIGURES.api_status[r.status_code] = FIGURES.api_status.get(r.status_code, 0) + 1
    if r.status_code >= 500:
        FIGURES.api_server_errors += 1
    assert r.status_code < 500, f"{method} {r.request.url}: {r.status_code} {r.text[:500]}"
    if allowed and method not in allowed:
        assert r.status_code == 405, f"{method} {r.request.url}: {r.status_code}"
    if r.status_code >= 400 and method != "HEAD":
        body = r.json()
        dialect = dialect_of(r.request.url.path)
        if dialect == "ollama":
            assert set(body) == {"error"} and isinstance(body["error"], str), body
            assert body["error"], body
            return
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and err["type"], err
        if dialect == "anthropic":
            assert body["type"] == "error" and set(err) == {"type", "message"}, body
        else:
            assert "param" in err and "code" in err, err


@pytest.fixture
def client(env: Env) -> Iterator[httpx.Client]:
    mark = env.log_mark()
    with httpx.Client(base_url=env.node.api, timeout=30.0) as c:
        yield c
    assert env.node.alive()
    assert stable_state(env.node) == env.baseline, "the API changed the cluster state"
    log = env.log_since(mark)
    assert "Traceback" not in log, f"an exception was logged:\n{log[-6000:]}"
    assert completion(env.node) == env.reference, "greedy text changed"
    FIGURES.checks += 1


def _send(c: httpx.Client, method: str, path: str, body: bytes | None, ctype: str | None,
          query: dict[str, str] | None = None) -> httpx.Response:  # fmt: skip
    headers = {} if ctype is None else {"content-type": ctype}
    return c.request(method, path, content=body, headers=headers, params=query or None)


# -- tests -----------------------------------------------------------------------------------
def test_routes_are_found() -> None:
    assert {"/v1/chat/completions", "/v1/completions", "/v1/instances"} <= set(ROUTES)
    assert all(ROUTES.values())


def test_random_requests_on_every_route(env: Env, client: httpx.Client) -> None:
    @fuzz_settings(1000)
    @given(req=requests())
    def one(req) -> None:
        method, template, path, allowed, body, ctype, query = req
        if ctype is not None and (
            any(ord(ch) < 32 or ord(ch) > 126 for ch in ctype) or ctype != ctype.strip(" \t")
        ):
            # Not sendable as a header otherwise (h11 refuses control characters and
            # leading or trailing whitespace in a value).
            ctype = urllib.parse.quote(ctype)
        try:
            _screen(method, template, path, body, env)
        except _Skip:
            return
        r = _send(client, method, path, body, ctype, query)
        _check_response(r, method, allowed)

    one()


#: One violation per entry: (field, bad value); the rest of the body is valid and names
#: the default model, so a missed check would run a real completion (and fail here).
_COMMON_BAD: list[tuple[str, Any]] = [
    ("model", None), ("model", 5), ("model", ""), ("model", "   "), ("model", ["m"]),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", "8"),
    ("max_tokens", True), ("max_tokens", 2**70), ("max_tokens", 2**63),
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"), ("temperature", 1e400),
    ("top_p", 0), ("top_p", 1.5), ("top_p", -1), ("top_k", -1), ("top_k", 2**64),
    ("top_k", 2**70), ("top_k", 0.5), ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", "s"),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", [""]), ("stop", 5), ("stop", [1]),
    ("n", 9), ("n", 0), ("n", -5), ("n", 2**70), ("presence_penalty", 3),
    ("frequency_penalty", -2.5), ("logit_bias", {"1": 101.0}), ("logit_bias", {"x": 1}),
    ("logit_bias", {"99999999": 1.0}), ("logit_bias", []), ("min_p", 1.5),
    ("repeat_penalty", 0), ("repeat_last_n", -2),
    ("stream", "yes"), ("stream_options", []), ("ignore_eos", "no"),
]  # fmt: skip
_CHAT_BAD: list[tuple[str, Any]] = [
    ("messages", []), ("messages", None), ("messages", "hi"), ("messages", [1]),
    ("messages", [{"role": "robot", "content": "x"}]), ("messages", [{"role": "user"}]),
    ("messages", [{"content": "x"}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    ("messages", [{"role": "user", "content": [{"type": "text"}]}]),
    ("messages", [{"role": "user", "content": 7}]),
    ("messages", [{"role": "user", "content": [{"text": "x"}]}]),
    ("max_completion_tokens", 0), ("logprobs", "yes"), ("top_logprobs", 2),
    ("top_logprobs", -1),
    ("response_format", {"type": "yaml"}), ("response_format", "text"),
    ("response_format", {"type": "json_schema"}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}),
    ("tools", [{"type": "function"}]), ("functions", [{}]), ("tools", {}),
]  # fmt: skip
_COMPLETION_BAD: list[tuple[str, Any]] = [
    ("prompt", None), ("prompt", 5), ("prompt", []), ("prompt", ["a", "b"]), ("prompt", [1, 2]),
    ("prompt", [[1]]), ("echo", True), ("best_of", 2), ("logprobs", 21), ("logprobs", -1),
    ("suffix", "tail"),
]  # fmt: skip
_VALID = {
    "/v1/chat/completions": {"model": "smollm2-135m", "max_tokens": 4, "temperature": 0,
                             "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4,
                        "temperature": 0},
}  # fmt: skip
_KNOWN = set(schemas.ChatCompletionRequest.__struct_fields__) | set(
    schemas.CompletionRequest.__struct_fields__
)


_HI = [{"role": "user", "content": "Hi"}]
#: The other dialects: a valid body of each, and its own violations.
_DIALECTS: dict[str, tuple[dict[str, Any], list[tuple[str, Any]]]] = {
    "/v1/messages": (
        {"model": "smollm2-135m", "max_tokens": 4, "temperature": 0, "messages": _HI},
        [("model", ""), ("model", None), ("max_tokens", 0), ("max_tokens", None),
         ("max_tokens", 2**70), ("temperature", 1.5), ("top_p", 0), ("top_k", -1),
         ("stop_sequences", [""]), ("stop_sequences", ["a"] * 17), ("messages", []),
         ("messages", [{"role": "system", "content": "x"}]),
         ("messages", [{"role": "user", "content": [{"type": "image", "source": {}}]}]),
         ("messages", [{"role": "user", "content": [{"type": "tool_result"}]}]),
         ("system", 5), ("tools", [{"name": "bad name!", "input_schema": {}}]),
         ("tools", [{"type": "bash_20250124", "name": "bash"}]),
         ("tool_choice", {"type": "tool"}), ("tool_choice", {"type": "any"})],
    ),
    "/api/chat": (
        {"model": "smollm2-135m", "messages": _HI, "stream": False,
         "options": {"num_predict": 4, "temperature": 0}},
        [("model", ""), ("options", {"temperature": -1}), ("options", {"top_p": 0}),
         ("options", {"stop": [""]}), ("options", {"seed": 2**64}), ("options", {"top_k": -1}),
         ("options", []), ("messages", "hi"), ("messages", [{"role": "robot", "content": "x"}]),
         ("messages", [{"role": "user", "content": "x", "images": ["aGk="]}]),
         ("format", "yaml"), ("format", {"type": "nonsense"}), ("think", "extreme"),
         ("tools", [{"type": "function"}]), ("tool_choice", "maybe"), ("top_logprobs", 99)],
    ),
    "/v1/responses": (
        {"model": "smollm2-135m", "input": "Hi", "max_output_tokens": 4, "temperature": 0},
        [("input", ""), ("input", []), ("input", 5), ("max_output_tokens", 0),
         ("temperature", 3), ("previous_response_id", "resp_1"),
         ("tools", [{"type": "web_search"}]), ("tool_choice", "required"),
         ("text", {"format": {"type": "yaml"}}),
         ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])],
    ),
    "/api/generate": (
        {"model": "smollm2-135m", "prompt": "Hi", "stream": False,
         "options": {"num_predict": 4, "temperature": 0}},
        [("options", {"min_p": 2}), ("suffix", "tail"), ("template", "{{ .Prompt }}"),
         ("context", [1, 2]), ("images", ["aGk="]), ("prompt", 5), ("raw", "yes")],
    ),
}  # fmt: skip


@st.composite
def violations(draw) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(sorted([*_VALID, *_DIALECTS])))
    if path in _DIALECTS:
        valid, own = _DIALECTS[path]
        body = dict(valid)
        field, bad = draw(st.sampled_from(own))
        body[field] = bad
        return path, body
    own = _CHAT_BAD if path == "/v1/chat/completions" else _COMPLETION_BAD
    body = dict(_VALID[path])
    # Unknown fields are ignored by design: add some next to the violation.
    unknown = st.text(max_size=10).filter(lambda k: k not in _KNOWN)
    body.update(draw(st.dictionaries(unknown, _json, max_size=3)))
    field, bad = draw(st.sampled_from(_COMMON_BAD + own))
    body[field] = bad
    if field == "max_completion_tokens" and draw(st.booleans()):
        body["max_tokens"], body[field] = 3, 5  # both given and disagreeing
    return path, body


def test_schema_violations_of_real_requests_are_400(env: Env, client: httpx.Client) -> None:
    @fuzz_settings(400)
    @given(case=violations(), stream=st.booleans())
    def one(case: tuple[str, dict[str, Any]], stream: bool) -> None:
        path, body = case
        if stream and "stream" not in body:
            body = {**body, "stream": True}
        raw = json.dumps(body, allow_nan=True).encode()
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        _check_response(r, "POST", {"POST"})
        assert r.status_code == 400, f"{path} {body}: {r.status_code} {r.text[:300]}"

    one()


def _special_cases() -> Iterator[tuple[str, str, bytes | None, dict[str, str], int]]:
    """(method, path, body, headers, expected status) for the edges the generator
    rarely reaches: size limits, nesting, encodings."""
    big = b'{"model": "m", "prompt": "' + b"x" * (8 * 1024 * 1024) + b'"}'
    json_h = {"content-type": "application/json"}
    for path in BODY_TYPES:
        m = "DELETE" if "DELETE" in ROUTES[path] else "POST"
        yield m, path, big, json_h, 413
        yield m, path, b"[" * 200_000 + b"]" * 200_000, json_h, 400
        yield m, path, b"{" * 100_000, json_h, 400
        yield m, path, b'{"model": "\xc3\x28"}', json_h, 400
        yield m, path, b'{"model": "\\ud800"}', json_h, 400
        yield m, path, b"\xef\xbb\xbf{}", json_h, 400
        yield m, path, b"null", json_h, 400
        yield m, path, b"", json_h, 400
        yield m, path, b"{}", {"content-type": "text/plain"}, 415


def _raw(env: Env, request: bytes) -> tuple[int, bytes]:
    """Send bytes httpx would refuse to send (a lying Content-Length); status and body."""
    host, port = env.node.api.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_size_limits_nesting_and_encodings(env: Env, client: httpx.Client) -> None:
    for method, path, body, headers, status in _special_cases():
        r = client.request(method, path, content=body, headers=headers)
        _check_response(r, method, {method})
        assert r.status_code == status, f"{path} {body[:40]!r}: {r.status_code} {r.text[:200]}"


def test_declared_length_over_the_limit_is_413_before_the_body(env: Env) -> None:
    for path in BODY_TYPES:
        m = "DELETE" if "DELETE" in ROUTES[path] else "POST"
        req = (
            f"{m} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{ADMIN_HEADER}: {ADMIN_KEY}\r\n"  # admin routes are the owner's, as meshctl
            f"Content-Length: {9 * 1024 * 1024}\r\nConnection: close\r\n\r\n{{}}"
        ).encode()
        status, body = _raw(env, req)
        FIGURES.api_cases += 1
        FIGURES.api_status[status] = FIGURES.api_status.get(status, 0) + 1
        assert status == 413, body
        err = json.loads(body)["error"]
        assert "request body is larger" in (err if isinstance(err, str) else err["message"]).lower()


_odd_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\x00", "\ufffd",
                     "{{ raise('x') }}", "{% for %}", "\r\n" * 20, "🦙" * 10]),
)  # fmt: skip


@st.composite
def odd_valid(draw) -> tuple[str, dict[str, Any]]:
    """A valid request for the real model with unusual values (kept short to run)."""
    body: dict[str, Any] = {
        "model": draw(st.sampled_from(["smollm2-135m", "SmolLM2-135M-Instruct", " smollm2-135m "])),
        "max_tokens": draw(st.integers(1, 3)),
        "temperature": draw(st.sampled_from([0, 0.0, 1e-9, 1, 2])),
        "top_p": draw(st.sampled_from([None, 1e-9, 0.5, 1])),
        "top_k": draw(st.sampled_from([None, 0, 1, 2**62])),
        "seed": draw(st.sampled_from([None, 0, -1, -(2**63), 2**63 - 1])),
        "stop": draw(st.none() | _odd_text.filter(bool) | st.lists(_odd_text.filter(bool),
                                                                   max_size=4)),
        "stream": draw(st.booleans()),
        "stream_options": draw(st.sampled_from([None, {"include_usage": True}, {}])),
        "ignore_eos": draw(st.booleans()),
        "presence_penalty": draw(st.sampled_from([None, -2, 2])),
        "n": draw(st.sampled_from([None, 1, 2])),
        "user": draw(st.text(max_size=5)),
    }  # fmt: skip
    body = {k: v for k, v in body.items() if v is not None}
    if draw(st.booleans()):
        roles = st.sampled_from(["system", "user", "assistant", "developer", "tool"])
        part = st.builds(lambda t: {"type": "text", "text": t}, _odd_text)
        content = _odd_text | st.lists(part, min_size=1, max_size=2)
        message = st.builds(lambda r, c: {"role": r, "content": c}, roles, content)
        body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
        return "/v1/chat/completions", body
    body["prompt"] = draw(_odd_text | st.lists(_odd_text, min_size=1, max_size=1))
    return "/v1/completions", body


def _events(r: httpx.Response) -> list[dict]:
    """The JSON events of an SSE body, checking its framing; [DONE] last."""
    lines = [ln for ln in r.text.split("\n\n") if ln]
    assert lines and lines[-1] == "data: [DONE]", r.text[-300:]
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]


def test_valid_requests_with_odd_values_complete(env: Env, client: httpx.Client) -> None:
    """Not bad input: odd but valid requests run on the real model and answer 200 (or
    a 400 the pipeline decides, like an empty prompt), in OpenAI's shape."""

    @fuzz_settings(25)
    @given(case=odd_valid())
    def one(case: tuple[str, dict[str, Any]]) -> None:
        path, body = case
        r = client.post(path, json=body)
        _check_response(r, "POST", {"POST"})
        assert r.status_code in (200, 400), f"{body}: {r.status_code} {r.text[:300]}"
        if r.status_code != 200:
            assert r.json()["error"]["code"] == "bad_prompt", r.text  # an empty prompt
            return
        if body["stream"]:
            events = _events(r)
            assert not any("error" in e for e in events), events
            n = body.get("n") or 1
            finish = [c["finish_reason"] for e in events for c in e["choices"]]
            assert len([f for f in finish if f]) == n, events
            assert {f for f in finish if f} <= {"stop", "length"}, events
        else:
            answer = r.json()
            n = body.get("n") or 1
            assert len(answer["choices"]) == n, answer
            for choice in answer["choices"]:
                assert choice["finish_reason"] in ("stop", "length"), answer
            # usage counts every choice's tokens, as OpenAI's does.
            assert answer["usage"]["completion_tokens"] <= body["max_tokens"] * n, answer

    one()

"""Ollama's API through the official ``ollama`` client, on the default model split over
two nodes and asked of a third that holds no stage."""

from __future__ import annotations

import http.client
import json
import time

import httpx
import msgspec
import pytest

from meshd.api.ollama_schemas import ChatRequest
from meshd.models.resolve import DEFAULT_MODEL
from tests.api.reference import WEATHER, greedy_chat
from tests.cluster import metric_total, wait_for

ollama = pytest.importorskip("ollama")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(300)

HI = [{"role": "user", "content": "Say hello in one short sentence."}]
#: Fewer tokens than the greedy answer to HI has: it ends by length.
N = 8
GREEDY = {"temperature": 0, "num_predict": N}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
          "description": "The current weather in a city", "parameters": WEATHER}}]  # fmt: skip


def test_chat_matches_the_openai_route_and_reports_measured_timings(oc, via) -> None:
    r = oc.chat(model=DEFAULT_MODEL, messages=HI, options=GREEDY)
    ref = greedy_chat(via, HI, N)
    assert r.message.role == "assistant"
    assert r.message.content == ref["choices"][0]["message"]["content"]
    assert r.done and r.done_reason == "length"
    assert r.prompt_eval_count == ref["usage"]["prompt_tokens"]
    assert r.eval_count == N
    # Measured, and consistent with one another: each part within the total.
    assert 0 < r.eval_duration < r.total_duration
    assert 0 < r.prompt_eval_duration < r.total_duration
    assert r.load_duration + r.prompt_eval_duration + r.eval_duration <= r.total_duration
    # The package's instance is exact; ``options.exact: false`` (the ollama client sends
    # options on as given) lets this one start from the prompt the one before kept.
    hits = metric_total(via, "meshd_prefix_cache_hits_total")
    warm = oc.chat(model=DEFAULT_MODEL, messages=HI, options={**GREEDY, "exact": False})
    assert warm.eval_count == N
    assert metric_total(via, "meshd_prefix_cache_hits_total") > hits


def test_streamed_chat_is_ndjson_and_ends_with_the_timings(oc) -> None:
    whole = oc.chat(model=DEFAULT_MODEL, messages=HI, options=GREEDY)
    parts = list(oc.chat(model=DEFAULT_MODEL, messages=HI, options=GREEDY, stream=True))
    assert len(parts) > 2
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == N and parts[-1].total_duration > 0


def test_generate_templates_the_prompt_unless_raw(oc, via) -> None:
    r = oc.generate(model=DEFAULT_MODEL, prompt="Say hello in one short sentence.",
                    options=GREEDY)  # fmt: skip
    assert r.response == greedy_chat(via, HI, N)["choices"][0]["message"]["content"]
    raw = oc.generate(model=DEFAULT_MODEL, prompt="The capital of France is", raw=True,
                      options=GREEDY)  # fmt: skip
    ref = httpx.post(via.api + "/v1/completions", timeout=120,
                     json={"model": DEFAULT_MODEL, "prompt": "The capital of France is",
                           "temperature": 0, "max_tokens": N}).json()  # fmt: skip
    assert raw.response == ref["choices"][0]["text"]
    parts = list(oc.generate(model=DEFAULT_MODEL, prompt="The capital of France is", raw=True,
                             options=GREEDY, stream=True))  # fmt: skip
    assert "".join(p.response for p in parts) == raw.response


def test_options_are_honoured(oc) -> None:
    r = oc.chat(model=DEFAULT_MODEL, messages=HI,
                options={"num_predict": 40, "temperature": 0, "stop": [" "]})  # fmt: skip
    assert " " not in r.message.content and r.done_reason == "stop"
    seeded = [
        oc.chat(model=DEFAULT_MODEL, messages=HI,
                options={"num_predict": 10, "temperature": 1.0, "seed": 7, "top_k": 50,
                         "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1}).message.content
        for _ in range(2)
    ]  # fmt: skip
    assert seeded[0] == seeded[1]


def test_format_json_and_schema(oc) -> None:
    r = oc.chat(model=DEFAULT_MODEL, format="json", options={"num_predict": 60, "seed": 1},
                messages=[{"role": "user", "content": "Describe a cat as JSON."}])  # fmt: skip
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}  # fmt: skip
    r = oc.chat(model=DEFAULT_MODEL, format=schema, options={"num_predict": 80, "seed": 2},
                messages=[{"role": "user", "content": "A person, as JSON."}])  # fmt: skip
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)


def test_tool_calls_come_back_as_objects_and_their_results_are_read(oc, via) -> None:
    asked = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    # Ollama has no tool_choice; meshd's extension forces a call, so this small model
    # makes one. The official client's own types parse the answer.
    body = {"model": DEFAULT_MODEL, "messages": asked, "tools": TOOLS, "stream": False,
            "tool_choice": "required", "options": {"seed": 1, "num_predict": 80}}  # fmt: skip
    r = httpx.post(via.api + "/api/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = ollama.ChatResponse(**r.json())
    (call,) = got.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(call.function.arguments, dict)
    jsonschema.validate(dict(call.function.arguments), WEATHER)
    with httpx.stream("POST", via.api + "/api/chat", json={**body, "stream": True},
                      timeout=120) as s:  # fmt: skip
        parts = [ollama.ChatResponse(**json.loads(line)) for line in s.iter_lines() if line]
    streamed = [c for p in parts for c in p.message.tool_calls or ()]
    assert [c.function.name for c in streamed] == ["get_weather"] and parts[-1].done
    history = [
        *asked,
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": dict(call.function.arguments)}}]},
        {"role": "tool", "tool_name": "get_weather", "content": '{"celsius": 18}'},
    ]  # fmt: skip
    final = oc.chat(model=DEFAULT_MODEL, messages=history, tools=TOOLS,
                    options={"num_predict": 30, "seed": 1})  # fmt: skip
    assert final.done
    assert final.message.content or final.message.tool_calls


def test_embed_and_the_older_embeddings_route(oc, via) -> None:
    r = oc.embed(model=DEFAULT_MODEL, input=["a cat", "a dog"])
    assert len(r.embeddings) == 2 and r.prompt_eval_count > 0
    ref = httpx.post(via.api + "/v1/embeddings", timeout=120,
                     json={"model": DEFAULT_MODEL, "input": "a cat"}).json()  # fmt: skip
    assert r.embeddings[0] == pytest.approx(ref["data"][0]["embedding"], abs=1e-6)
    old = oc.embeddings(model=DEFAULT_MODEL, prompt="a cat")
    assert old.embedding == pytest.approx(r.embeddings[0], abs=1e-6)


def test_model_routes(oc, via) -> None:
    names = [m.model for m in oc.list().models]
    assert DEFAULT_MODEL in names
    entry = next(m for m in oc.list().models if m.model == DEFAULT_MODEL)
    assert entry.size > 0 and entry.details.family == "llama"
    assert entry.details.parameter_size == "135M"  # from the tensors' shapes
    ps = oc.ps().models
    assert [m.model for m in ps] == [DEFAULT_MODEL] and ps[0].context_length > 0
    shown = oc.show(DEFAULT_MODEL + ":latest")  # the tag Ollama clients add
    assert "tools" in shown.capabilities and "completion" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] > 0
    assert shown.modelinfo["general.parameter_count"] == 134_515_008
    assert shown.details.parameter_size == "135M"
    v = httpx.get(via.api + "/api/version", timeout=10).json()["version"]
    assert all(p.isdigit() for p in v.split("."))
    assert httpx.get(via.api + "/", timeout=10).text == "Ollama is running"
    # Pulling a model some node holds places it (here it is placed already).
    assert oc.pull(DEFAULT_MODEL).status == "success"
    assert [p.status for p in oc.pull(DEFAULT_MODEL, stream=True)][-1] == "success"


def test_errors_are_in_ollamas_shape(oc, via) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="no-such-model", messages=HI)
    assert e.value.status_code == 404
    assert DEFAULT_MODEL in e.value.error  # the models the cluster serves are listed
    for body in (
        {"model": DEFAULT_MODEL, "messages": HI, "options": {"temperature": -1}},
        {"model": DEFAULT_MODEL, "messages": "hi"},
        {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": "x", "images": ["aGk="]}],
        },
        {"model": DEFAULT_MODEL, "messages": HI, "format": {"type": "nonsense"}},
        {"model": DEFAULT_MODEL, "messages": HI, "think": "extreme"},
        {"model": DEFAULT_MODEL, "messages": HI, "keep_alive": "soon"},
        # meshd's own tool_choice (a string) still names a tool that is there.
        {"model": DEFAULT_MODEL, "messages": HI, "tools": TOOLS, "tool_choice": "nope"},
    ):
        r = httpx.post(via.api + "/api/chat", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()) == {"error"} and r.json()["error"], r.text
    r = httpx.post(via.api + "/api/pull", json={"model": "no-such-model"}, timeout=30)
    assert r.status_code == 404 and set(r.json()) == {"error"}
    r = httpx.post(via.api + "/api/create", json={"model": "x"}, timeout=30)
    assert r.status_code == 400 and "not supported" in r.json()["error"]
    r = httpx.post(via.api + "/api/nope", json={}, timeout=30)
    assert r.status_code == 404 and set(r.json()) == {"error"}


def test_an_empty_chat_loads_the_model(oc) -> None:
    r = oc.chat(model=DEFAULT_MODEL, messages=[])
    assert r.done and r.done_reason == "load"
    r = oc.generate(model=DEFAULT_MODEL, prompt="")
    assert r.done and r.done_reason == "load"


def test_keep_alive_0_unloads_the_model_and_the_next_request_loads_it_again(oc, via) -> None:
    # Its stages run on a and b, the requests come through c: c's word travels in its
    # heartbeat, a and b stop their runners, and c's next request wakes them (it waits).
    first = oc.chat(model=DEFAULT_MODEL, messages=HI, options=GREEDY, keep_alive=0)
    (inst,) = [i for i in via.get("/v1/instances")["data"] if i["model"] == DEFAULT_MODEL]
    path = f"/v1/instances/{inst['id']}"
    wait_for(lambda: via.get(path)["state"] == "unloaded", 60, 0.1)
    assert {s["state"] for s in via.get(path)["stages"]} == {"unloaded"}
    assert DEFAULT_MODEL not in [m.model for m in oc.ps().models]  # as Ollama: not loaded
    again = oc.chat(model=DEFAULT_MODEL, messages=HI, options=GREEDY, keep_alive="10m")
    assert again.message.content == first.message.content and again.done_reason == "length"
    assert via.get(path)["state"] == "ready"

    def expiry() -> float | None:
        (m,) = [m for m in oc.ps().models if m.model == DEFAULT_MODEL]
        return m.expires_at.timestamp() if m.expires_at.year < 9999 else None

    # c's word (in its next heartbeat) says when: 10 minutes after the request.
    wait_for(lambda: expiry() is not None, 30, 0.1)
    assert 540 < (expiry() or 0) - time.time() <= 600
    oc.generate(model=DEFAULT_MODEL, prompt="", keep_alive=-1)  # as before, for the others


def test_a_tool_choice_object_is_ignored_as_ollama_ignores_it(via) -> None:
    # ollama-ai-provider-v2 sends OpenAI's object; Ollama has no such field. (No
    # messages: the body is read and checked, the model loaded, nothing generated.)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"model": DEFAULT_MODEL, "messages": [], "tools": TOOLS, "tool_choice": choice}
    r = httpx.post(via.api + "/api/chat", json={**body, "stream": False}, timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text
    read = msgspec.convert({**body, "messages": HI}, ChatRequest)
    assert read.tool_choice is None and read.tool_mode == "auto"


def test_a_body_with_no_json_type_is_read_unless_a_browser_sent_it(via) -> None:
    # LiteLLM's ollama/ providers send no Content-Type, curl -d (Ollama's docs) a form's:
    # Ollama reads both as JSON. Plain http.client, so no header is added on the way.
    host, port = via.api.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": DEFAULT_MODEL, "prompt": "Hi", "stream": False,
                       "options": {"num_predict": 1}}).encode()  # fmt: skip

    def post(path: str, headers: dict[str, str]) -> tuple[int, dict]:
        c = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            c.request("POST", path, body=body, headers=headers)
            r = c.getresponse()
            return r.status, json.loads(r.read())
        finally:
            c.close()

    status, got = post("/api/generate", {})
    assert status == 200 and got["done"] and got["eval_count"] == 1, got
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert post("/api/generate", form)[0] == 200
    # A browser's post carries an Origin: another site's is refused, and a page of the
    # node's own must say JSON; so must a request any browser marks as cross-site.
    status, got = post("/api/generate", {"Origin": "http://evil.example"})
    assert status == 403 and "Origin" in got["error"]
    for marks in ({"Origin": via.api}, {"Sec-Fetch-Site": "cross-site"},
                  {**form, "Sec-Fetch-Site": "cross-site"}):  # fmt: skip
        status, got = post("/api/generate", marks)
        assert status == 415 and "Content-Type" in got["error"], marks
    # Only Ollama's routes: the others take JSON said so (tests/api/test_http_guards.py).
    assert post("/v1/completions", {})[0] == 415

"""The official `openai` client against a node that holds no stage of a 2-stage instance.

Three real nodes on loopback: the default model is split over a and b, and every request
goes to c, which computes nothing of it: what the client sees is what the API and the
pipeline do together, on real engines.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import httpx
import numpy as np
import pytest

from meshd.models.resolve import DEFAULT_MODEL, resolve_model
from tests.cluster import NodeProc, wait_for
from tests.synthetic import write_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)


def _text(client, prompt: str, **kw) -> str:
    r = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, **kw)
    return r.choices[0].text


def test_a_request_naming_no_sampling_field_gets_the_documented_defaults(client) -> None:
    prompt = "The three best things about autumn are"
    plain = _text(client, prompt, max_tokens=40, seed=11)
    again = _text(client, prompt, max_tokens=40, seed=11)
    explicit = _text(
        client, prompt, max_tokens=40, seed=11, temperature=0.8, top_p=0.95,
        extra_body={"top_k": 40, "min_p": 0.05},
    )  # fmt: skip
    assert plain == again == explicit
    # Other defaults would draw other text under the same seed (T=1, no filters).
    wide = _text(
        client, prompt, max_tokens=40, seed=11, temperature=1.0, top_p=1.0,
        extra_body={"top_k": 0, "min_p": 0.0},
    )  # fmt: skip
    assert wide != plain


def _repeats(text: str) -> int:
    words = text.split()
    return sum(n - 1 for n in Counter(words).values())


def test_penalties_change_how_often_tokens_repeat(client) -> None:
    prompt = "List: apple, apple, apple, apple, apple, apple,"
    kw = {"max_tokens": 48, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = _text(client, prompt, **kw)
    freq = _text(client, prompt, frequency_penalty=2.0, **kw)
    pres = _text(client, prompt, presence_penalty=2.0, **kw)
    rep = _text(client, prompt, **{**kw, "extra_body": {"ignore_eos": True, "repeat_penalty": 1.8}})
    assert _repeats(plain) > 20, plain  # greedy on this prompt says "apple," again and again
    for penalised in (freq, pres, rep):
        assert _repeats(penalised) < _repeats(plain) / 2, (plain, penalised)
    # Greedy with penalties is still deterministic.
    assert _text(client, prompt, frequency_penalty=2.0, **kw) == freq


def _token_id(text: str) -> int:
    from llama_cpp import Llama

    llm = Llama(resolve_model(DEFAULT_MODEL).path, vocab_only=True, verbose=False)
    try:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        llm.close()
    assert len(ids) == 1, ids
    return ids[0]


def test_logit_bias_forces_and_bans_tokens(client) -> None:
    banana = _token_id(" banana")
    forced = _text(
        client, "My favourite colour is", max_tokens=5, temperature=0.7, seed=3,
        logit_bias={str(banana): 100},
    )  # fmt: skip
    assert forced == " banana" * 5
    greedy = _text(client, "The capital of France is", max_tokens=1, temperature=0)
    paris = _token_id(greedy)
    banned = _text(
        client, "The capital of France is", max_tokens=1, temperature=0,
        logit_bias={str(paris): -100},
    )  # fmt: skip
    assert banned != greedy
    # A token past the vocabulary is a 400 naming the field, in OpenAI's shape.
    with pytest.raises(openai.BadRequestError) as e:
        _text(client, "Hi", max_tokens=2, logit_bias={"99999999": 5})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        _text(client, "Hi", max_tokens=2, extra_body={"min_p": 2})
    assert e.value.body["param"] == "min_p"


def test_a_model_that_ships_its_sampling_gets_it_by_default(
    client, trio: dict[str, NodeProc], model_path, a_models
) -> None:
    # A model whose authors say "greedy": requests naming no field decode greedily.
    # An untied random head: flat logits, so sampling shows (a tied one repeats its input).
    path = write_model(a_models / "greedy.gguf", model_path, "llama", tied=False,
                       metadata={"general.sampling.temp": 0.0})  # fmt: skip
    # Placed through a's own API, from a's --models folder.
    owner, via = trio["a"].api, trio["c"]
    r = httpx.post(owner + "/v1/instances", json={"model": str(path), "nodes": ["a"]}, timeout=60)
    assert r.status_code == 201, r.text
    try:
        iid = r.json()["id"]
        stages = f"/v1/instances/{iid}"
        wait_for(lambda: all(s["state"] == "ready" for s in via.get(stages)["stages"]), 60, 0.2)
        texts = {
            client.completions.create(model=str(path), prompt="Hello", max_tokens=12, seed=s)
            .choices[0]
            .text
            for s in range(4)
        }
        assert len(texts) == 1  # the seed does not matter: greedy
        sampled = {
            client.completions.create(
                model=str(path), prompt="Hello", max_tokens=12, seed=s, temperature=1.0
            )
            .choices[0]
            .text
            for s in range(4)
        }
        assert len(sampled) > 1  # a request's own field still wins
    finally:
        httpx.delete(f"{owner}/v1/instances/{iid}", timeout=10)


def test_chat_logprobs_come_from_the_distribution_each_token_was_drawn_from(client) -> None:
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    r = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=msgs, max_tokens=24, logprobs=True, top_logprobs=5, seed=5
    )
    content = r.choices[0].logprobs.content
    # One per token of the answer; the usage counts the end token too when the answer
    # ended on it (as llama-server's does), which has no text and no logprob.
    on_eos = r.choices[0].finish_reason == "stop"
    assert content and len(content) == r.usage.completion_tokens - on_eos
    assert "".join(t.token for t in content) == r.choices[0].message.content
    cut = math.log(0.05)  # the default min_p
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 5
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.logprob >= tops[0] + cut - 1e-6  # nothing sampled below the min-p cut
        assert bytes(t.bytes).decode(errors="replace") == t.token
    # Without logprobs: none in the answer.
    plain = client.chat.completions.create(model=DEFAULT_MODEL, messages=msgs, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_reassemble_to_the_whole_answers(client) -> None:
    msgs = [{"role": "user", "content": "Name three fruits."}]
    kw = {"model": DEFAULT_MODEL, "messages": msgs, "max_tokens": 20, "temperature": 0,
          "logprobs": True, "top_logprobs": 2}  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for ev in client.chat.completions.create(stream=True, **kw):
        if ev.choices and ev.choices[0].logprobs and ev.choices[0].logprobs.content:
            streamed += ev.choices[0].logprobs.content
    assert [(t.token, round(t.logprob, 6)) for t in streamed] == [
        (t.token, round(t.logprob, 6)) for t in whole
    ]


def test_completion_logprobs_match_a_recomputation_from_the_whole_model(client) -> None:
    from llama_cpp import Llama

    from meshd.engines.threads import default_threads

    prompt, n = "The capital of France is", 12
    r = client.completions.create(
        model=DEFAULT_MODEL, prompt=prompt, max_tokens=n, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == len(prompt)
    assert lp.text_offset == [len(prompt) + len("".join(lp.tokens[:i])) for i in range(n)]
    assert all(len(alts) <= 3 for alts in lp.top_logprobs)
    # The whole model in llama-cpp-python, greedy, token by token: same tokens, and the
    # same log-probabilities (the split adds only float noise).
    t = default_threads()
    llm = Llama(resolve_model(DEFAULT_MODEL).path, n_ctx=512, flash_attn=False, logits_all=True,
                n_threads=t, n_threads_batch=t, verbose=False)  # fmt: skip
    try:
        llm.eval(llm.tokenize(prompt.encode(), add_bos=True, special=False))
        for i in range(n):
            logits = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
            logp = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
            tok = int(np.argmax(logits))
            assert llm.detokenize([tok]).decode(errors="replace") == lp.tokens[i]
            assert lp.token_logprobs[i] == pytest.approx(logp[tok], abs=2e-3)
            best = max(lp.top_logprobs[i].values())
            assert best == pytest.approx(logp.max(), abs=2e-3)
            llm.eval([tok])
    finally:
        llm.close()


def test_n_choices_each_sampled_and_streamed_by_index(client) -> None:
    msgs = [{"role": "user", "content": "Give me a name for a cat."}]
    r = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=msgs, n=3, max_tokens=12, seed=21, temperature=1.0
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert all(texts) and len(set(texts)) > 1  # three draws, not one copied
    # Streamed: each choice's deltas under its own index, each finished once. (Not
    # compared with the answer above: choices decode batched together, and a batch's
    # float sums differ from another batch's, which moves a near-tie draw.)
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=msgs, n=3, max_tokens=12, seed=21, temperature=1.0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finished: list[int] = []
    usage = None
    for ev in stream:
        for ch in ev.choices:
            parts[ch.index].append(ch.delta.content or "")
            if ch.finish_reason:
                finished.append(ch.index)
        usage = ev.usage or usage
    assert sorted(finished) == [0, 1, 2]
    assert all("".join(p) for p in parts.values())
    assert usage is not None and usage.prompt_tokens == r.usage.prompt_tokens  # counted once
    assert 3 <= usage.completion_tokens <= 36
    # Completions too; logprobs per choice.
    c = client.completions.create(
        model=DEFAULT_MODEL, prompt="Once upon a time", n=2, max_tokens=6, logprobs=1, seed=4
    )
    assert [ch.index for ch in c.choices] == [0, 1]
    assert all(len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) for ch in c.choices)


def test_a_base_url_ending_in_api_v1_works_as_v1(via: NodeProc) -> None:
    # Open WebUI and others are sometimes given http://HOST:PORT/api/v1.
    c = openai.OpenAI(base_url=via.api + "/api/v1", api_key="unused", timeout=60, max_retries=0)
    assert DEFAULT_MODEL in [m.id for m in c.models.list()]
    r = c.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert r.usage.completion_tokens <= 3 and r.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError) as e:  # OpenAI's error shape, not Ollama's
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["code"] == "model_not_found"


def test_models_retrieve_finds_a_served_model_and_404s_any_other(client, via) -> None:
    m = client.models.retrieve(DEFAULT_MODEL)
    assert m.id == DEFAULT_MODEL and m.object == "model"
    # An id may hold "/" and ":" (org/repo, name:tag); the SDK sends the "/" encoded.
    for missing in ("no-such-model", "org/no-such-model:q4"):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(missing)
        assert e.value.body["code"] == "model_not_found" and DEFAULT_MODEL in e.value.message
    r = httpx.get(via.api + "/api/v1/models/" + DEFAULT_MODEL, timeout=10)
    assert r.status_code == 200 and r.json()["id"] == DEFAULT_MODEL
    r = httpx.get(via.api + "/v1/models/org/no-such-model:q4", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_every_request_leaves_one_log_line_whatever_its_outcome(via: NodeProc) -> None:
    chat = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1}  # fmt: skip
    url = via.api + "/v1/chat/completions"

    def rid(name: str) -> dict[str, str]:
        return {"X-Request-Id": name}

    sent = {
        "log-served": httpx.post(url, json=chat, headers=rid("log-served"), timeout=60),
        "log-no-model": httpx.post(url, json={**chat, "model": "nope"},
                                   headers=rid("log-no-model"), timeout=30),
        "log-no-type": httpx.post(url, content=b"{}", headers=rid("log-no-type"), timeout=30),
        "log-foreign-host": httpx.get(via.api + "/v1/models", timeout=30,
                                      headers={**rid("log-foreign-host"), "Host": "evil.example"}),
        "log-ollama": httpx.post(via.api + "/api/chat", json={**chat, "messages": "hi"},
                                 headers=rid("log-ollama"), timeout=30),
    }  # fmt: skip
    assert [r.status_code for r in sent.values()] == [200, 404, 415, 403, 400]

    def lines() -> dict[str, list[str]] | None:
        log = via.log().splitlines()
        got = {name: [ln for ln in log if " meshd.api: " in ln and ln.endswith(f" req={name}")]
               for name in sent}  # fmt: skip
        return got if all(got.values()) else None

    got = wait_for(lines, 10)
    for name, r in sent.items():
        assert len(got[name]) == 1, got[name]  # one line each, refusals too
        line = got[name][0]
        assert f" {r.request.method} {r.request.url.path} {r.status_code} " in line, line
    # A request that ran on the pipeline says how, on the same line (its stages: a and
    # b, or wherever a repair put the model on a busy machine).
    assert f": chat {DEFAULT_MODEL} via " in got["log-served"][0]
    assert ": 200, " in got["log-served"][0]


def test_turn_two_of_a_chat_reports_its_cached_tokens(client) -> None:
    turn1 = [
        {"role": "system", "content": "You answer in one short sentence, like a librarian."},
        {"role": "user", "content": "Where do I find books about whales?"},
    ]
    r1 = client.chat.completions.create(model=DEFAULT_MODEL, messages=turn1, max_tokens=20,
                                        temperature=0)  # fmt: skip
    history = [
        *turn1,
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And about sharks?"},
    ]
    # Greedy requests use the cache unasked, as llama.cpp's server does, unless they
    # run exact, as every request on this package's instance does unless it says not.
    r2 = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=history, max_tokens=8, temperature=0,
        extra_body={"exact": False},
    )  # fmt: skip
    assert r2.usage.prompt_tokens_details is not None
    assert r1.usage.prompt_tokens <= r2.usage.prompt_tokens_details.cached_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens
    # Asked for a cold run, a request computes its whole prompt; so does an exact one.
    for cold in ({"exact": False, "cache_prompt": False}, {}):
        r3 = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=history, max_tokens=8, temperature=0,
            extra_body=cold,
        )  # fmt: skip
        assert r3.usage.prompt_tokens_details is None, cold


def _phases(via: NodeProc) -> dict[str, tuple[float, float]]:
    """(sum, count) of each phase of ``meshd_first_token_phase_seconds`` at ``via``."""
    out: dict[str, tuple[float, float]] = {}
    for ln in httpx.get(via.api + "/metrics", timeout=10).text.splitlines():
        if ln.startswith("meshd_first_token_phase_seconds_") and 'phase="' in ln:
            phase = ln.split('phase="')[1].split('"')[0]
            s, c = out.get(phase, (0.0, 0.0))
            value = float(ln.split()[-1])
            out[phase] = (s + value, c) if "_sum{" in ln else (s, c + value * ("_count{" in ln))
    return out


def test_a_first_tokens_phases_fit_within_the_clients_wait(client, via) -> None:
    before = _phases(via)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=4, temperature=0, stream=True,
    )  # fmt: skip
    waited = next(time.perf_counter() - t0 for ev in stream if ev.choices[0].delta.content)
    for _ in stream:
        pass
    after = _phases(via)
    took = {p: after[p][0] - before.get(p, (0.0, 0.0))[0] for p in after}
    assert {p: after[p][1] - before.get(p, (0.0, 0.0))[1] for p in after} == dict.fromkeys(
        ["api", "admit", "stage0", "prefill", "deliver"], 1.0
    )
    # Each came from the node's own clock (stage 0's part from stage 0's): together
    # no longer than the client waited, and the prefill ran on real engines.
    assert took["prefill"] > 0 and 0 < took["stage0"] <= took["admit"]
    assert sum(took[p] for p in ("api", "admit", "prefill", "deliver")) <= waited


def test_a_request_that_quotes_its_input_is_drafted_and_verified(client, via) -> None:
    code = "def area(width, height):\n    return width * height\n"
    asked = [{"role": "user", "content": f"Repeat this code exactly:\n{code}"}]
    spec = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=asked, max_tokens=48, temperature=0,
        extra_body={"exact": False},  # on a split, greedy requests draft unasked
    )  # fmt: skip
    assert spec.choices[0].message.content
    metrics = httpx.get(via.api + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(name))

    assert total("meshd_draft_tokens_total") > 0
    assert 0 <= total("meshd_draft_tokens_accepted_total") <= total("meshd_draft_tokens_total")
    # With no draft model, the request's own text wrote every draft.
    lookup = f'meshd_draft_tokens_total{{model="{DEFAULT_MODEL}",proposer="lookup"}}'
    assert total(lookup) == total("meshd_draft_tokens_total")

"""The official `openai` client against a node that holds no stage of a 2-stage instance.

Three real nodes on loopback: the default model is split over a and b, and every request
goes to c, which computes nothing of it: what the client sees is what the API and the
pipeline do together, on real engines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL, resolve_model
from tests.cluster import Cluster, NodeProc, wait_for
from tests.synthetic import write_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, NodeProc]]:
    """A 3-node cluster whose default model is split over a and b."""
    with Cluster(tmp_path_factory.mktemp("openai")) as c:
        a = c.start("a")
        b = c.start("b", peers=[a])
        cc = c.start("c", peers=[a])
        wait_for(lambda: len(cc.cluster()["nodes"]) == 3, 15)
        r = httpx.post(a.api + "/v1/instances", timeout=60,
                       json={"model": DEFAULT_MODEL, "nodes": ["a", "b"]})  # fmt: skip
        assert r.status_code == 201, r.text
        path = f"/v1/instances/{r.json()['id']}"
        wait_for(lambda: all(s["state"] == "ready" for s in cc.get(path)["stages"]), 90, 0.2)
        yield {"a": a, "b": b, "c": cc}


@pytest.fixture(scope="module")
def via(trio: dict[str, NodeProc]) -> NodeProc:
    """Node c: it holds no stage of the split."""
    return trio["c"]


@pytest.fixture(scope="module")
def client(via: NodeProc):
    return openai.OpenAI(base_url=via.api + "/v1", api_key="unused", timeout=120, max_retries=0)


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
    client, trio: dict[str, NodeProc], model_path, tmp_path
) -> None:
    # A model whose authors say "greedy": requests naming no field decode greedily.
    # An untied random head: flat logits, so sampling shows (a tied one repeats its input).
    path = write_model(tmp_path / "greedy.gguf", model_path, "llama", tied=False,
                       metadata={"general.sampling.temp": 0.0})  # fmt: skip
    # Placed through a's own API: a path given there is one of a's model roots.
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

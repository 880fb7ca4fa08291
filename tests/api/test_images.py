"""Images in, through the official clients (``openai``, ``anthropic``, ``ollama``):
a synthetic vision model (``tests/synthetic_vision.py``: a small llama text model and
an MLP projector beside it) split over nodes a and b answers an image request with
the very greedy tokens of the same model run whole on node a; what cannot be read is
a 400 in the caller's dialect, and changes nothing.

The two instances are two copies of the same files, each named by its folder as a's
scan lists it (so b fetches its slice of the split from a)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import NodeProc, wait_for
from tests.synthetic_vision import N_IMAGE_ROWS, png, write_vision_model

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")

pytestmark = pytest.mark.timeout(300)

RED, BLUE = png(8, 8, seed=1), png(20, 12, seed=2)
TEXT = "What is in this picture?"
N = 8


def _url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def _chat(image: bytes, text: str = TEXT) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": _url(image)}},
    ]}]  # fmt: skip


def _place(owner: NodeProc, via: NodeProc, model: str, nodes: list[str]) -> str:
    # A node that lacks the model is placeable once the owner knows a holder's facts
    # of it (it fetches its slice then); a model written a moment ago may not have
    # them yet, and the placement is refused meanwhile (ci69: "b ... is not a live
    # node"). Ask again until it is taken.
    wait_for(lambda: all(owner.liveness().get(n) == "alive" for n in nodes), 30, 0.2)
    body = {"model": model, "nodes": nodes}
    sent: list[httpx.Response] = []

    def taken() -> bool:
        sent.append(httpx.post(owner.api + "/v1/instances", json=body, timeout=60))
        assert sent[-1].status_code in (201, 400), sent[-1].text
        return sent[-1].status_code == 201

    wait_for(taken, 30, 0.5)
    r = sent[-1]
    path = f"/v1/instances/{r.json()['id']}"

    def ready() -> bool:
        # Every stage where it was placed: b fetches its slice from a (a stage that
        # gave up would be moved, and the split would be no split).
        stages = via.get(path)["stages"]
        assert not [s for s in stages if s["state"] == "failed"], stages
        assert [s["name"] for s in stages] == nodes, stages
        return all(s["state"] == "ready" for s in stages)

    wait_for(ready, 120, 0.2)
    return path


@pytest.fixture(scope="module")
def vision(trio: dict[str, NodeProc], a_models: Path, model_path: Path) -> Iterator[dict]:
    """The vision model split over a and b, and a copy of it whole on a."""
    write_vision_model(a_models / "vision-split", model_path)
    write_vision_model(a_models / "vision-whole", model_path)
    owner, via = trio["a"], trio["c"]
    names = {"vision-split", "vision-whole"}
    wait_for(lambda: names <= {m["id"] for m in via.get("/v1/models")["data"]}, 30, 0.1)
    placed = []
    try:
        placed.append(_place(owner, via, "vision-split", ["a", "b"]))
        placed.append(_place(owner, via, "vision-whole", ["a"]))
        yield {"split": "vision-split", "whole": "vision-whole"}
    finally:
        for path in placed:
            httpx.delete(owner.api + path, timeout=10)


def _openai(client, model: str, image: bytes, **extra) -> str:
    r = client.chat.completions.create(
        model=model, messages=_chat(image), max_tokens=N, temperature=0, extra_body=extra
    )
    assert r.usage.prompt_tokens > 4, r.usage  # the image's rows count as prompt
    return r.choices[0].message.content


def test_split_equals_whole_through_openai_anthropic_and_ollama(client, ac, oc, vision) -> None:
    split, whole = vision["split"], vision["whole"]
    # Exact (meshd.domain.exact): float32 hops, nothing reused or drafted.
    assert _openai(client, split, RED, exact=True) == _openai(client, whole, RED, exact=True)

    def anth(model: str) -> str:
        data = base64.b64encode(BLUE).decode()
        m = ac.messages.create(model=model, max_tokens=N, extra_body={"temperature": 0,
                               "exact": True}, messages=[
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": data}},
                {"type": "text", "text": TEXT},
            ]},
        ])  # fmt: skip
        return "".join(b.text for b in m.content if b.type == "text")

    assert anth(split) == anth(whole)

    def olla(model: str) -> str:
        r = oc.chat(model=model, options={"temperature": 0, "num_predict": N, "exact": True},
                    messages=[{"role": "user", "content": TEXT, "images": [RED]}])  # fmt: skip
        return r.message.content

    assert olla(split) == olla(whole)


def _first_logprobs(client, model: str, image: bytes, **extra) -> tuple[dict, int, int]:
    """The first token's top logprobs of a greedy answer, the prompt's tokens and
    those the prefix cache gave."""
    r = client.chat.completions.create(
        model=model, messages=_chat(image), max_tokens=2, temperature=0, logprobs=True,
        top_logprobs=5, extra_body=extra,
    )  # fmt: skip
    top = {t.token: t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs}
    details = r.usage.prompt_tokens_details
    return top, r.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


def _distance(a: dict, b: dict) -> float:
    return max(abs(a[t] - b[t]) if t in a and t in b else 99.0 for t in {*a, *b})


def test_the_image_moves_the_answer_and_the_prefix_cache_keys_on_it(client, vision) -> None:
    split = vision["split"]
    # Cold runs (every kept prefix dropped first), so only BLUE's KV is kept after.
    red, _, _ = _first_logprobs(client, split, RED, cache_prompt=False)
    blue, n_prompt, _ = _first_logprobs(client, split, BLUE, cache_prompt=False)
    apart = _distance(red, blue)
    assert apart > 1e-3  # the rows reach the model: another image, other odds
    # The last answer's KV is kept (BLUE's). With the prefix cache on, the same text
    # with another image takes the text before the image from it, and no more: its
    # odds stay its own (a reused prefix moves low bits only).
    warm, _, cached = _first_logprobs(client, split, RED, cache_prompt=True)
    assert 0 < cached < n_prompt - N_IMAGE_ROWS
    assert _distance(warm, red) < apart / 10
    # The same image again: its rows come from the cache too.
    _, _, again = _first_logprobs(client, split, RED, cache_prompt=True)
    assert again == n_prompt - 1


def _refused(client, model: str, url: str) -> str:
    """The 400's text for a chat whose one part is the image at ``url``."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=N, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
        ])  # fmt: skip
    return str(e.value)


def test_remote_image_urls_are_refused_nodes_never_fetch(client, ac, vision) -> None:
    remote = "https://example.com/cat.png"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=vision["split"], max_tokens=N, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": remote}}]},
        ])  # fmt: skip
    assert "not fetched" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as ea:
        ac.messages.create(model=vision["split"], max_tokens=N, messages=[
            {"role": "user", "content": [{"type": "image",
                                          "source": {"type": "url", "url": remote}}]},
        ])  # fmt: skip
    assert "not fetched" in str(ea.value)


def test_a_model_without_projector_says_so_in_each_dialect(client, ac, oc, vision) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=_chat(RED), max_tokens=N)
    assert "reads text only" in str(e.value)
    data = base64.b64encode(RED).decode()
    with pytest.raises(anthropic.BadRequestError) as ea:
        ac.messages.create(model=DEFAULT_MODEL, max_tokens=N, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": data}}]},
        ])  # fmt: skip
    assert "reads text only" in str(ea.value)
    with pytest.raises(ollama.ResponseError) as eo:
        oc.chat(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi", "images": [RED]}])
    assert eo.value.status_code == 400 and "reads text only" in str(eo.value)


def test_bad_images_are_a_clear_400_and_change_nothing(client, via, vision) -> None:
    split = vision["split"]
    before = _openai(client, split, RED)
    assert "not valid base64" in _refused(client, split, "data:image/png;base64,%%%")
    text = "data:image/png;base64," + base64.b64encode(b"just some text").decode()
    assert "is not an image" in _refused(client, split, text)
    # A file that starts like a PNG and is none: stage 0's decoder says so.
    broken = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode()
    assert "could not be decoded" in _refused(client, split, broken)
    # (the ollama client checks base64 itself: the body as another client sends it)
    bad = {"model": split, "messages": [{"role": "user", "content": "hi", "images": ["%%%"]}]}
    r = httpx.post(via.api + "/api/chat", json=bad, timeout=30)
    assert r.status_code == 400 and "not valid base64" in r.json()["error"], r.text
    assert _openai(client, split, RED) == before

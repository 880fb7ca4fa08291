"""A real model split across real nodes on loopback, served from any node's API."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL, resolve_model
from tests.cluster import Cluster, NodeProc, wait_for

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    "Once upon a time",
    "Voilà l'été à Zürich: ñandú, 日本語のテキスト, emoji 🚀 and",
    # A long prompt (several hundred tokens) exercises a big prefill through every stage.
    " ".join(
        f"Paragraph {i}: the quick brown fox jumps over the lazy dog near the river bank."
        for i in range(30)
    )
    + " In summary,",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[str, str]]:
    """Greedy completions of llama-cpp-python running the whole GGUF, same settings.

    Runners on the CPU use plain attention (flash attention off), F16 K/V and
    ``default_threads()``; the high-level class uses half the cores unless asked.
    Either difference moves near-ties (the order of float sums changes).
    """
    from llama_cpp import Llama

    from meshd.engines.threads import default_threads

    t = default_threads()
    llm = Llama(
        resolve_model(DEFAULT_MODEL).path, n_ctx=4096, flash_attn=False,
        n_threads=t, n_threads_batch=t, verbose=False,
    )  # fmt: skip
    out = {}
    for p in PROMPTS:
        r = llm(p, max_tokens=MAX_TOKENS, temperature=0.0, repeat_penalty=1.0)
        out[p] = (r["choices"][0]["text"], r["choices"][0]["finish_reason"])
    llm.close()
    return out


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProc]]:
    """Three nodes on loopback, none serving anything yet."""
    with Cluster(tmp_path_factory.mktemp("trio")) as c:
        a = c.start("a")
        b = c.start("b", peers=[a], wait=False)
        cc = c.start("c", peers=[a], wait=False)
        c.wait_ready(b)
        c.wait_ready(cc)
        nodes = [a, b, cc]
        wait_for(lambda: all(len(n.cluster()["nodes"]) == 3 for n in nodes), 10)
        yield nodes


def place(via: NodeProc, nodes: list[NodeProc]) -> dict:
    """Place the default model on ``nodes`` (stage order) and wait until it serves."""
    r = httpx.post(
        via.api + "/v1/instances",
        json={"model": DEFAULT_MODEL, "nodes": [n.name for n in nodes]},
        timeout=30,
    )
    assert r.status_code == 201, r.text
    inst = r.json()
    assert [s["node"] for s in inst["stages"]] == [n.node_id for n in nodes]

    def ready() -> bool:
        got = via.get(f"/v1/instances/{inst['id']}")
        return all(s["state"] == "ready" for s in got["stages"])

    wait_for(ready, 60, interval=0.2)
    return inst


def remove(via: NodeProc, inst: dict, nodes: list[NodeProc]) -> None:
    """Delete an instance and wait until no node runs any of its stages."""
    r = httpx.delete(f"{via.api}/v1/instances/{inst['id']}", timeout=10)
    assert r.status_code == 200, r.text

    def gone() -> bool:
        for n in nodes:
            for m in n.cluster()["nodes"]:
                if any(x["instance"] == inst["id"] for x in (m["health"] or {}).get("runners", [])):
                    return False
        return True

    wait_for(gone, 15, interval=0.2)


def agrees_up_to_a_near_tie(logprobs: dict, want: str, margin: float = 1.5) -> bool:
    """Whether an answer's tokens spell ``want`` up to where they leave it on a token
    whose log-probability was within ``margin`` of the one ``want`` goes on with."""
    text = ""
    for tok, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        if want.startswith(text + tok):
            text += tok
            continue
        return any(
            alt != tok and want.startswith(text + alt) and top[tok] - lp < margin
            for alt, lp in top.items()
        )
    return text == want


def complete(via: NodeProc, prompt: str, **kw) -> dict:
    """A greedy completion, exact (compared with llama.cpp's: no kept prefix, no
    drafts) unless ``kw`` says."""
    body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "exact": True, **kw}  # fmt: skip
    r = httpx.post(via.api + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _active(nodes: list[NodeProc], instance: str) -> int:
    n_active = 0
    for m in nodes[0].cluster()["nodes"]:
        for r in (m["health"] or {}).get("runners", []):
            if r["instance"] == instance:
                n_active += r.get("active", 0)
    return n_active


class Serving:
    """The one instance of the default model on the trio (a request for the model goes
    to whichever instance serves it: one at a time). A test that asks for the nodes it
    is on gets it again, if no request is left in it, rather than waiting for another
    to load; tests are ordered so that each set of nodes is placed once."""

    def __init__(self, trio: list[NodeProc]) -> None:
        self.trio = trio
        self.inst: dict | None = None
        self.holders: list[str] = []

    def on(self, holders: list[NodeProc], fresh: bool = False) -> dict:
        """The instance on ``holders`` (stage order); ``fresh``: newly placed, no
        request served before (no prefix of another request cached)."""
        names = [n.name for n in holders]
        if (
            not fresh
            and self.inst is not None
            and self.holders == names
            and _active(self.trio, self.inst["id"]) == 0
        ):
            return self.inst
        if self.inst is not None:
            inst, self.inst = self.inst, None
            remove(self.trio[0], inst, self.trio)
        self.inst, self.holders = place(self.trio[0], holders), names
        return self.inst


@pytest.fixture(scope="module")
def serving(trio: list[NodeProc]) -> Serving:
    return Serving(trio)


@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_greedy_output_of_a_pipeline_equals_llama_cpp_on_the_whole_model(
    trio: list[NodeProc],
    reference: dict[str, tuple[str, str]],
    serving: Serving,
    n_stages: int,
) -> None:
    holders = trio[:n_stages]
    via = trio[-1]  # with 1 or 2 stages, a node holding no stage serves the API
    inst = serving.on(holders, fresh=True)
    assert len(inst["stages"]) == n_stages
    for p in PROMPTS:
        got = complete(via, p)
        text, finish = reference[p]
        assert (got["choices"][0]["text"], got["choices"][0]["finish_reason"]) == (text, finish)
        if finish == "length":  # an answer may end on its own (EOS) first
            assert got["usage"]["completion_tokens"] == MAX_TOKENS


# The tests below run on the instance the one above left on all three nodes, then on
# two, then on one.


def test_client_disconnect_mid_stream_frees_the_kv_on_every_stage(
    trio: list[NodeProc], serving: Serving
) -> None:
    inst = serving.on(trio)
    body = {
        "model": DEFAULT_MODEL, "prompt": "Write a very long story.", "max_tokens": 2000,
        "temperature": 0, "stream": True, "ignore_eos": True,
    }  # fmt: skip
    with httpx.stream("POST", trio[1].api + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        # Keep the line iterator referenced: dropping a half-read httpx iterator
        # closes the connection, which is the disconnect this test makes below.
        lines = r.iter_lines()
        got = 0
        while got < 5:
            if next(lines).startswith("data: {"):
                got += 1
        # Mid-stream: every stage holds the request.
        wait_for(lambda: _active(trio, inst["id"]) == 3, 5, interval=0.05)
        r.close()
    t0 = time.monotonic()
    wait_for(lambda: _active(trio, inst["id"]) == 0, 5, interval=0.05)
    assert time.monotonic() - t0 < 5


def test_client_gone_from_a_non_streaming_request_frees_the_kv_on_every_stage(
    trio: list[NodeProc], serving: Serving
) -> None:
    inst = serving.on(trio)
    body = {
        "model": DEFAULT_MODEL, "prompt": "Write a very long story.", "max_tokens": 2000,
        "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    # The client gives up (a read timeout, as an SDK's retry logic would) while the
    # pipeline is generating: nobody will read the answer, so it must stop.
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            httpx.post(
                trio[1].api + "/v1/completions", json=body,
                timeout=httpx.Timeout(5, read=2.0),
            )  # fmt: skip
        except httpx.ReadTimeout as e:
            outcome.append(e)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    wait_for(lambda: _active(trio, inst["id"]) == 3, 5, interval=0.05)  # generating
    t.join(10)
    assert outcome, "the request was expected to time out at the client"
    t0 = time.monotonic()
    wait_for(lambda: _active(trio, inst["id"]) == 0, 3, interval=0.05)
    assert time.monotonic() - t0 < 3
    assert trio[1].get("/healthz")["requests_in_flight"] == 0


def test_two_requests_at_once_through_two_stages_both_complete(
    trio: list[NodeProc], reference: dict[str, tuple[str, str]], serving: Serving
) -> None:
    serving.on(trio[:2])
    results: dict[str, str] = {}

    def run(p: str) -> None:
        results[p] = complete(trio[2], p, logprobs=3)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(results) == set(PROMPTS[:2])
    for p, body in results.items():
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        # Each its own answer: the reference's, but where a batch of two summed
        # floats in another order than one alone and flipped a near-tie.
        assert agrees_up_to_a_near_tie(body["choices"][0]["logprobs"], reference[p][0]), (
            body["choices"][0]["text"],
            reference[p][0],
        )


def test_openai_client_against_a_node_that_holds_no_stage(
    trio: list[NodeProc], serving: Serving
) -> None:
    openai = pytest.importorskip("openai")
    serving.on(trio[:2])
    client = openai.OpenAI(base_url=trio[2].api + "/v1", api_key="unused", timeout=60)
    models = [m.id for m in client.models.list()]
    assert DEFAULT_MODEL in models
    msgs = [{"role": "user", "content": "Name a colour."}]
    exact = {"exact": True}  # the stream must give the text the whole one gave
    whole = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=msgs, max_tokens=16, temperature=0, extra_body=exact
    )
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens <= 16
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=exact,
    )  # fmt: skip
    parts, usage = [], None
    for ev in stream:
        if ev.choices and ev.choices[0].delta.content:
            parts.append(ev.choices[0].delta.content)
        if ev.usage is not None:
            usage = ev.usage
    assert "".join(parts) == text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=4)


def test_prompt_over_the_context_is_a_400_and_changes_nothing(
    trio: list[NodeProc], serving: Serving
) -> None:
    serving.on(trio[:1])
    long = "word " * 9000
    r = httpx.post(trio[1].api + "/v1/completions",
                   json={"model": DEFAULT_MODEL, "prompt": long, "max_tokens": 4},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert complete(trio[1], PROMPTS[0])["choices"][0]["text"]

"""``POST /v1/embeddings`` through the official `openai` client, on the default model
split over two nodes and asked of a third."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest

from meshd.engines.llama_stage import LlamaStage
from meshd.engines.stage import StageInput
from meshd.models.pooling import pool
from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, wait_for
from tests.synthetic import write_bert

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)

TEXTS = [
    "The cat sat on the mat.",
    "A kitten was sitting on the rug.",
    "Interest rates rose again this quarter.",
    "hello",
]


@pytest.fixture(scope="module")
def whole(model_path: Path) -> np.ndarray:
    """The same texts embedded by the whole model in this process (one stage)."""
    with LlamaStage(model_path, first=True, last=True, n_ctx=512, n_seq_max=1) as s:
        out = []
        for t in TEXTS:
            toks = np.asarray(s.tokenize(t, add_special=True, parse_special=False), np.int32)
            out.append(pool(s.embed([StageInput(seq=0, pos=0, tokens=toks)])[0], "mean"))
        return np.stack(out)


def test_a_split_instance_gives_the_whole_models_vectors(client, whole, model_path) -> None:
    r = client.embeddings.create(model=DEFAULT_MODEL, input=TEXTS)
    got = np.array([d.embedding for d in r.data])
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    assert got.shape == (len(TEXTS), 576)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    cos = np.sum(got * whole, axis=1)
    assert cos.min() >= 0.9999, cos
    # Near texts are nearer than far ones.
    assert got[0] @ got[1] > got[0] @ got[2]
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    # llama-cpp-python on the same GGUF, mean pooling, normalised.
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(
        str(model_path), embedding=True, verbose=False, n_ctx=512,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    )  # fmt: skip
    want = np.asarray(ref.embed(TEXTS, normalize=True))
    assert np.sum(got * want, axis=1).min() > 0.998


def test_floats_base64_strings_and_token_ids_agree(client, via: NodeProc) -> None:
    floats = client.embeddings.create(
        model=DEFAULT_MODEL, input="The cat sat on the mat.", encoding_format="float"
    )
    v = np.array(floats.data[0].embedding, np.float32)
    raw = httpx.post(
        via.api + "/v1/embeddings",
        json={"model": DEFAULT_MODEL, "input": ["The cat sat on the mat."],
              "encoding_format": "base64"},
        timeout=60,
    ).json()  # fmt: skip
    b = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(b, v)
    ids = raw["usage"]["prompt_tokens"]
    assert ids == floats.usage.prompt_tokens
    # A token list and a list of one token list are the same input.
    tokens = client.embeddings.create(model=DEFAULT_MODEL, input=[[1, 504, 2644, 3294]])
    again = client.embeddings.create(model=DEFAULT_MODEL, input=[1, 504, 2644, 3294])
    np.testing.assert_array_equal(tokens.data[0].embedding, again.data[0].embedding)
    assert tokens.usage.prompt_tokens == 4


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": [1, "a"]}, 400, "input"),
        ({"input": {"text": "a"}}, 400, "input"),
        ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "a", "dimensions": 3}, 400, "dimensions"),
        ({"input": [[10**9]]}, 400, None),
        ({"input": "a", "model": "no-such-model"}, 404, "model"),
    ],
)
def test_bad_inputs_get_typed_errors(via: NodeProc, body, status, param) -> None:
    r = httpx.post(via.api + "/v1/embeddings", json={"model": DEFAULT_MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, r.text
    assert err["message"]


def test_an_embedding_model_places_on_one_node_and_only_embeds(
    cluster: Cluster, tmp_path: Path, model_path: Path
) -> None:
    """A BERT GGUF from a node's model dir: /v1/embeddings serves it (as llama-cpp-python
    computes it); completions and a split are refused, saying why."""
    llama_cpp = pytest.importorskip("llama_cpp")
    models = tmp_path / "models"
    models.mkdir()
    bert = write_bert(models / "bert-mini.gguf", model_path, pooling=2)
    a = cluster.start("a", extra_args=["--models", str(models)])
    b = cluster.start("b", peers=[a], extra_args=["--models", str(models)])
    wait_for(lambda: len(b.cluster()["nodes"]) == 2, 15)
    split = httpx.post(a.api + "/v1/instances", json={"model": str(bert), "min_nodes": 2},
                       timeout=60)  # fmt: skip
    assert split.status_code in (400, 409), split.text
    assert "encoder" in split.json()["error"]["message"]
    client = openai.OpenAI(base_url=a.api + "/v1", api_key="unused", timeout=120, max_retries=0)
    r = client.embeddings.create(model=str(bert), input=TEXTS)
    got = np.array([d.embedding for d in r.data])
    ref = llama_cpp.Llama(str(bert), embedding=True, verbose=False, n_ctx=512)
    want = np.asarray(ref.embed(TEXTS, normalize=True))
    assert np.sum(got * want, axis=1).min() > 0.9999
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=str(bert), messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert e.value.body["param"] == "model"
    assert e.value.body["code"] == "model_not_generative"

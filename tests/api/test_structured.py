"""Structured outputs through the official `openai` client: ``response_format``
``json_object`` and ``json_schema`` constrain the default 135M model, split over two
nodes, to JSON that parses and validates, every time."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import NodeProc

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(600)

# Every string, array and integer is bounded, so every answer can end: with an unbounded
# string the small model once looped inside a title until the node's token cap, past
# the client's timeout. max_tokens (a character can take 3 byte tokens) bounds the rest.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PRODUCT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "price": {"type": "number", "minimum": 0, "maximum": 100000},
        "in_stock": {"type": "boolean"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "maxItems": 3,
        },
    },
    "required": ["title", "price", "in_stock", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
        "celsius": {"type": "integer", "minimum": -60, "maximum": 60},
        "wind": {
            "type": "object",
            "properties": {
                "kmh": {"type": "integer", "minimum": 0, "maximum": 300},
                "from": {"enum": ["N", "E", "S", "W"]},
            },
            "required": ["kmh", "from"],
            "additionalProperties": False,
        },
    },
    "required": ["sky", "celsius", "wind"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "product": PRODUCT, "weather": WEATHER}

SUBJECTS = [
    "a retired teacher from Lyon", "a young painter", "a chess champion", "my neighbour",
    "a famous chef", "a kind nurse", "a sailor from Lisbon", "an old farmer",
    "a student in Tokyo", "a baker", "a red bicycle", "a cheap laptop", "a wool scarf",
    "a garden hose", "a coffee grinder", "an electric kettle", "a tennis racket",
    "a paperback novel", "winter in Oslo", "a summer day in Rome", "a storm at sea",
    "spring in Kyoto", "a foggy morning in London",
]  # fmt: skip


#: Prompts a run asks: each schema four times, every verb, subject and schema a new
#: pairing. Many more (bench-sized statistics) cost minutes of a 2-core CI run and
#: check the same mask; 12 still meet strings, numbers, enums, a nested object and an
#: array on every schema.
CASES = 12


def _cases(n: int = CASES) -> list[tuple[str, str]]:
    """``n`` different (schema name, prompt) pairs."""
    out: list[tuple[str, str]] = []
    verbs = ["Describe", "Give me JSON about", "Write a record for", "Tell me about"]
    for i in range(n):
        subject = SUBJECTS[(i * 7) % len(SUBJECTS)]
        name = list(SCHEMAS)[i % 3]
        out.append((name, f"{verbs[i % len(verbs)]} {subject}, as a {name} record."))
    assert len(set(out)) == n
    return out


def _ask(client, name: str, prompt: str, **kw):
    return client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
        },
        **{"max_tokens": 800, **kw},
    )


def test_a_dozen_prompts_give_a_dozen_answers_that_parse_and_validate(client) -> None:
    cases = _cases()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda c: _ask(client, *c), cases))
    for (name, prompt), r in zip(cases, answers, strict=True):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        doc = json.loads(choice.message.content)
        jsonschema.validate(doc, SCHEMAS[name])
    # The model still chooses what to say: not every answer is the same.
    assert len({a.choices[0].message.content for a in answers}) > CASES // 2


def test_json_object_mode_gives_an_object_and_streams_the_same_text(client) -> None:
    kw = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "List three fruits and their colours."}],
        "response_format": {"type": "json_object"},
        "seed": 5,
    }
    whole = client.chat.completions.create(**kw)
    doc = json.loads(whole.choices[0].message.content)
    assert isinstance(doc, dict)
    parts = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    ]
    assert "".join(parts) == whole.choices[0].message.content


def test_logprobs_of_a_constrained_answer_come_from_the_masked_distribution(client) -> None:
    r = _ask(client, "weather", "What is the weather like?", logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    # The first token must open the object: the mask leaves no other, so it is certain.
    assert content[0].token.startswith("{")
    assert content[0].logprob == pytest.approx(0.0, abs=1e-6)
    assert [t.token for t in content[0].top_logprobs] == [content[0].token]


def test_a_schema_the_grammar_engine_cannot_compile_is_a_400_that_says_why(
    client, via: NodeProc
) -> None:
    bad = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
        )
    err = e.value.body
    assert err["param"] == "response_format.json_schema.schema"
    assert err["code"] == "invalid_json_schema"
    assert "missing" in err["message"]
    for body, param in [
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
         "response_format.json_schema.schema"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}},
         "response_format.json_schema.schema"),
    ]:  # fmt: skip
        r = httpx.post(
            via.api + "/v1/chat/completions",
            json={"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "response_format": body},
            timeout=30,
        )  # fmt: skip
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text


def test_the_clients_own_parse_helper_gets_its_pydantic_model(client) -> None:
    """``client.chat.completions.parse`` turns a pydantic model into a strict schema
    (``$defs``, ``additionalProperties: false``) and parses the answer back into it."""
    pydantic = pytest.importorskip("pydantic")

    class Address(pydantic.BaseModel):
        street: str
        city: str

    class Contact(pydantic.BaseModel):
        name: str
        age: int
        emails: list[str]
        home: Address

    for seed in range(3):
        r = client.chat.completions.parse(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "Make up a contact card for a plumber."}],
            response_format=Contact,
            seed=seed,
            max_tokens=400,
        )
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Contact), r.choices[0].message.content
        assert isinstance(parsed.home, Address)

"""Grammar masks over the default model's real vocabulary (llama.cpp and MLX alike)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from meshd.engines.constraint import Constraint, GrammarVocab
from meshd.engines.grammar import (
    DEFAULT_MAX_STRING,
    GrammarError,
    bounded_strings,
    check_grammar,
    closed_objects,
    json_schema_grammar,
    lark_grammar,
)
from meshd.engines.llama_stage import LlamaStage
from meshd.models.tools import ParsedCall, ToolCallParser, forced_call_lark

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stage(model_path: Path):
    with LlamaStage(model_path, first=True, last=True, n_ctx=256, n_seq_max=1) as s:
        yield s


@pytest.fixture(scope="module")
def vocab(stage) -> GrammarVocab:
    return GrammarVocab(stage)


def _text(stage, tokens: list[int]) -> str:
    return b"".join(stage.token_to_piece(t) for t in tokens).decode("utf-8")


def _walk(vocab: GrammarVocab, grammar: str, rng: np.random.Generator) -> list[int]:
    """Tokens drawn uniformly among those the grammar allows, until it is complete."""
    c = Constraint(vocab, grammar)
    out: list[int] = []
    while not c.done:
        ids = np.flatnonzero(c.allowed())
        ids = ids[~np.isin(ids, list(vocab.eos))]
        if ids.size == 0:
            break  # only an end token is left: complete
        tok = int(rng.choice(ids))
        c.accept(tok)
        out.append(tok)
        assert len(out) < 5000, "a bounded grammar must end"
    return out


def test_uniformly_random_tokens_under_the_mask_give_valid_json_that_ends(stage, vocab) -> None:
    """The worst sampler there is (any allowed token, uniformly) still ends with JSON
    valid under the schema: strings are bounded, and the mask allows nothing else."""
    grammar = json_schema_grammar(SCHEMA)
    rng = np.random.default_rng(0)
    for _ in range(10):
        doc = json.loads(_text(stage, _walk(vocab, grammar, rng)))
        jsonschema.validate(doc, SCHEMA)
        assert len(doc["name"]) <= DEFAULT_MAX_STRING


def test_json_object_mode_gives_objects(stage, vocab) -> None:
    grammar = json_schema_grammar(None)
    rng = np.random.default_rng(1)
    for _ in range(5):
        assert isinstance(json.loads(_text(stage, _walk(vocab, grammar, rng))), dict)


def test_mask_sets_refused_tokens_to_minus_infinity_and_keeps_the_rest(vocab) -> None:
    c = Constraint(vocab, json_schema_grammar(SCHEMA))
    logits = np.linspace(-3, 3, vocab.n_vocab, dtype=np.float32)
    masked = c.mask(logits)
    ok = c.allowed()
    assert 0 < ok.sum() < 200  # the object must open: '{' and its few spellings
    assert np.array_equal(masked[ok], logits[ok])
    assert np.all(np.isneginf(masked[~ok]))
    assert logits.min() == -3  # the caller's logits are untouched
    # A padded output layer: the extra logits are refused too.
    wide = c.mask(np.zeros(vocab.n_vocab + 64, np.float32))
    assert np.all(np.isneginf(wide[vocab.n_vocab :]))


def test_a_refused_token_is_a_grammar_error(stage, vocab) -> None:
    c = Constraint(vocab, json_schema_grammar(SCHEMA))
    bad = stage.tokenize("hello", add_special=False, parse_special=False)[0]
    with pytest.raises(GrammarError, match="breaks the grammar"):
        c.accept(bad)


def test_a_replay_primed_with_its_history_continues_where_it_was(stage, vocab) -> None:
    grammar = json_schema_grammar(SCHEMA)
    tokens = _walk(vocab, grammar, np.random.default_rng(2))
    k = len(tokens) // 2
    live = Constraint(vocab, grammar)
    for t in tokens[:k]:
        live.accept(t)
    replayed = Constraint(vocab, grammar, history=tokens[:k])
    assert np.array_equal(live.allowed(), replayed.allowed())
    with pytest.raises(GrammarError):
        Constraint(vocab, grammar, history=stage.tokenize("nope", False, False))


def test_bounded_strings_only_narrows() -> None:
    schema = {
        "type": "object",
        "properties": {
            "free": {"type": "string"},
            "long": {"type": "string", "minLength": 1000},
            "own": {"type": "string", "maxLength": 5000},
            "either": {"type": ["string", "null"]},
            "picked": {"type": "string", "enum": ["x"]},
            "type": {"type": "string", "format": "date"},
        },
        "$defs": {"s": {"type": "string"}},
        "const": {"type": "string"},
    }
    out = bounded_strings(schema)
    p = out["properties"]
    assert p["free"]["maxLength"] == DEFAULT_MAX_STRING
    assert p["long"]["maxLength"] == 1000
    assert p["own"]["maxLength"] == 5000
    assert p["either"]["maxLength"] == DEFAULT_MAX_STRING
    assert "maxLength" not in p["picked"] and "maxLength" not in p["type"]
    assert out["$defs"]["s"]["maxLength"] == DEFAULT_MAX_STRING
    assert out["const"] == {"type": "string"}  # data, not a schema
    assert "maxLength" not in schema["properties"]["free"]  # the caller's is untouched


def test_check_grammar_says_why() -> None:
    with pytest.raises(GrammarError, match="strin"):
        check_grammar(json_schema_grammar({"type": "strin"}))
    with pytest.raises(GrammarError, match="object"):
        json_schema_grammar([1])  # type: ignore[arg-type]
    check_grammar(json_schema_grammar(SCHEMA))


def test_mlx_and_llama_read_the_same_vocabulary(model_path: Path, vocab) -> None:
    pytest.importorskip("mlx.core")
    from meshd.engines.mlx_stage import MlxStage

    with MlxStage(model_path, start=0, end=30, first=True, last=True, n_ctx=64, n_seq_max=1) as m:
        other = GrammarVocab(m)
    assert other.tokens == vocab.tokens
    assert other.eos == vocab.eos


@pytest.mark.parametrize(
    "fmt", ["hermes", "generic", "llama3", "mistral", "qwen3_coder", "glm45", "pythonic", "harmony"]
)
def test_a_forced_call_is_always_a_call_the_parser_reads_with_valid_arguments(
    stage, vocab, fmt
) -> None:
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city"],
    }
    tools = [
        {"name": "weather", "parameters": bounded_strings(closed_objects(params))},
        {"name": "noop"},
    ]
    grammar = lark_grammar(forced_call_lark(tools, fmt, None))
    check_grammar(grammar)
    rng = np.random.default_rng(3)
    for _ in range(5):
        p = ToolCallParser(fmt, tools)
        parts = p.feed(_text(stage, _walk(vocab, grammar, rng))) + p.finish()
        calls = [x for x in parts if isinstance(x, ParsedCall)]
        assert len(calls) == 1 and not [x for x in parts if isinstance(x, str) and x.strip()]
        args = json.loads(calls[0].arguments)
        if calls[0].name == "weather":
            jsonschema.validate(args, params)
            assert set(args) <= {"city", "days"}  # nothing the function does not declare
        else:
            assert calls[0].name == "noop"

"""A forced call (``tool_choice`` required or named) in every format: walked at random
through its llguidance grammar over a small byte-level vocabulary, it is always one
call the format's parser reads back, with arguments valid under the function's
schema; a marker the vocabulary holds as a control token costs that one token, and
the last stage shows it as text."""

from __future__ import annotations

import json
from typing import get_args

import jsonschema
import numpy as np
import pytest

from meshd.domain.chat import ToolSpec, ToolUse
from meshd.domain.job import Job
from meshd.engines.constraint import Constraint, GrammarVocab
from meshd.engines.detok import showing
from meshd.engines.grammar import (
    bounded_strings,
    check_grammar,
    closed_objects,
    lark_grammar,
)
from meshd.engines.runner.admission import Prompts
from meshd.models.tools import (
    ParsedCall,
    ToolCallParser,
    ToolFormat,
    control_tokens,
    forced_call_lark,
    tool_markers,
)

FORMATS: tuple[ToolFormat, ...] = get_args(ToolFormat)
EOS = "<eos>"
#: Every format's markers, as control tokens of the "special" vocabulary.
MARKERS = sorted({m for fmt in FORMATS for m in tool_markers(fmt)})


class ByteVocab:
    """A vocabulary of one token per byte (but 0xff, which llguidance keeps for control
    tokens), then ``specials`` as control tokens: what the grammar code reads of a
    stage (``n_vocab``, ``token_to_piece``, ``tokenize``, ``eos_tokens``)."""

    def __init__(self, specials: list[str]) -> None:
        self.specials = [*specials, EOS]
        self.n_vocab = 255 + len(self.specials)

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        if token < 255:
            return bytes([token])
        return self.specials[token - 255].encode() if special else b""

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False):
        data, out, i = text.encode(), [], 0
        if not parse_special:  # what llguidance asks, often: one token a byte
            return list(data)
        while i < len(data):
            hit = parse_special and next(
                (n for n, s in enumerate(self.specials) if data.startswith(s.encode(), i)), None
            )
            if hit is not None and hit is not False:
                out.append(255 + hit)
                i += len(self.specials[hit].encode())
            else:
                out.append(data[i])
                i += 1
        return out

    def eos_tokens(self) -> set[int]:
        return {self.n_vocab - 1}

    def special_texts(self) -> tuple[str, str]:
        return "", EOS


PLAIN, SPECIAL = ByteVocab([]), ByteVocab(MARKERS)
VOCABS = {"markers as text": PLAIN, "markers as control tokens": SPECIAL}
_GRAMMAR_VOCABS: dict[int, GrammarVocab] = {}

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["c", "f"]},
        "metric": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "where": {
            "type": "object",
            "properties": {"near": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        },
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"name": "weather", "parameters": bounded_strings(closed_objects(PARAMS))},
    {"name": "noop"},
]


def _specials(vocab: ByteVocab, fmt: ToolFormat) -> dict[str, int]:
    return control_tokens(
        tool_markers(fmt),
        lambda text: vocab.tokenize(text, parse_special=True),
        lambda token, special: vocab.token_to_piece(token, special=special),
    )


def _walk(vocab: ByteVocab, grammar: str, rng: np.random.Generator) -> list[int]:
    """Tokens drawn uniformly among those the grammar allows, until it is complete."""
    if id(vocab) not in _GRAMMAR_VOCABS:
        _GRAMMAR_VOCABS[id(vocab)] = GrammarVocab(vocab)
    gv = _GRAMMAR_VOCABS[id(vocab)]
    c = Constraint(gv, grammar)
    out: list[int] = []
    while not c.done:
        allowed = c.allowed().copy()
        allowed[list(gv.eos)] = False
        ids = np.flatnonzero(allowed)
        if ids.size == 0:
            break
        tok = int(rng.choice(ids))
        c.accept(tok)
        out.append(tok)
        assert len(out) < 2000, "the grammar never ends"
    return out


@pytest.mark.parametrize("vocab_kind", VOCABS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_forced_call_is_one_call_the_parser_reads_with_valid_arguments(fmt, vocab_kind) -> None:
    vocab = VOCABS[vocab_kind]
    specials = _specials(vocab, fmt)
    assert bool(specials) == (vocab is SPECIAL and bool(tool_markers(fmt)))
    rng = np.random.default_rng(7)
    for name in (None, "weather", "noop"):
        grammar = lark_grammar(forced_call_lark(TOOLS, fmt, name, specials))
        check_grammar(grammar)  # what stage 0 checks, with no vocabulary
        tokens = _walk(vocab, grammar, rng)
        # The last stage's text: the format's control tokens shown, as stage 0 asks.
        piece = showing(vocab.token_to_piece, specials.values())
        text = b"".join(piece(t) for t in tokens).decode()
        p = ToolCallParser(fmt, TOOLS)
        parts = p.feed(text) + p.finish()
        calls = [x for x in parts if isinstance(x, ParsedCall)]
        assert len(calls) == 1, text
        assert not [x for x in parts if isinstance(x, str) and x.strip()], text
        assert calls[0].name == (name or calls[0].name) in ("weather", "noop")
        args = json.loads(calls[0].arguments)
        if calls[0].name == "weather":
            jsonschema.validate(args, PARAMS)
            assert set(args) <= set(PARAMS["properties"])
        else:
            assert args == {}
        # Each marker the model holds as one control token is written as that token.
        for marker, token in specials.items():
            assert text.count(marker) == tokens.count(token)


def test_the_forced_wrapper_costs_one_token_a_marker() -> None:
    """DeepSeek V3.1's call around ``{}``: five markers, five tokens, and the name."""
    specials = _specials(SPECIAL, "deepseek_v31")
    grammar = lark_grammar(forced_call_lark(TOOLS, "deepseek_v31", "noop", specials))
    tokens = _walk(SPECIAL, grammar, np.random.default_rng(0))
    assert len(tokens) == 5 + len("noop") + len("{}")


def test_stage_0_shows_the_format_markers_only_to_requests_with_tools() -> None:
    template = "{% if tools %}{{ tools }}{% endif %}<|tool_calls_section_begin|><|tool_call_begin|>"
    prompts = Prompts(SPECIAL, template)  # type: ignore[arg-type]
    assert prompts.tool_format == "kimi_k2"
    ids = sorted(SPECIAL.tokenize("".join(tool_markers("kimi_k2")), parse_special=True))
    with_tools = Job(tools=ToolUse(tools=[ToolSpec(name="noop")], choice="required"))
    assert prompts.shown_specials(with_tools) == ids
    assert prompts.shown_specials(Job(prompt="hi")) == []
    # The forced call's grammar writes the markers as the control tokens.
    assert f"<[{ids[0]}]>" in (prompts.tool_grammar(with_tools) or "")

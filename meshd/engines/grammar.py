"""Grammar-constrained decoding: a token mask over the logits the sampler sees.

Structured outputs (a JSON schema, any JSON object) and forced tool calls are grammars;
the last stage of a plan keeps one :class:`Constraint` per such request, sets every
token the grammar cannot take next to ``-inf`` before :class:`~.sampling.Sampler` draws,
and feeds the drawn token back. Nothing here knows an engine: the vocabulary is read
through the stage contract (``token_to_piece``), so llama.cpp and MLX last stages mask
alike.

The grammar engine is llguidance (MIT, abi3 wheels for Linux and macOS, no torch). It
was picked over the other two libraries made for this:

* xgrammar needs torch and transformers (its bitmask is a torch tensor) and compiles a
  JSON schema in seconds on a CPU;
* outlines-core turns a schema into a regex (no recursive schemas) and its masks cost
  tens of ms per token;
* llguidance builds its token trie from a plain list of token bytes, compiles a schema
  in about a millisecond and computes a mask in ~10 us per token on the default model
  (measured here: ``bench/constrained.py``), and speaks JSON Schema, Lark and regex, so
  tool-call formats that wrap JSON in tags are one grammar.

A grammar travels on the wire as llguidance's own JSON definition (what
:func:`json_schema_grammar` and :func:`lark_grammar` return), checked by the API node
(:func:`check_grammar`, a 400 that says why) and compiled again by the last stage.
"""

from __future__ import annotations

from typing import Any

import llguidance

__all__ = [
    "JSON_STYLE",
    "LIMITS",
    "MAX_GRAMMAR_BYTES",
    "GrammarError",
    "check_grammar",
    "json_schema_grammar",
    "lark_grammar",
]

#: Largest grammar definition a request may carry (a schema of a few hundred fields
#: is well under it; the bound keeps a frame and a compile small).
MAX_GRAMMAR_BYTES = 256 * 1024

#: How generated JSON is laid out: one space after ``,`` and ``:`` and no other
#: whitespace. Free whitespace would let a small model pad with newlines forever; these
#: separators are the ones most JSON in training data uses, so the model's own
#: preferences survive the mask best.
JSON_STYLE: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

#: Longest string (in characters) the grammar lets a schema's unbounded ``string`` grow
#: to. Every answer within it is still valid under the client's schema; without it a
#: small model that starts repeating inside a string never closes it, and the answer
#: ends cut at ``max_tokens``, not parseable. A schema that wants longer strings says so
#: with its own ``maxLength``.
DEFAULT_MAX_STRING = 256

#: "Any JSON object" (``json_object`` mode), spelled out so that its strings are bounded
#: as a schema's are.
_ANY_OBJECT: dict[str, Any] = {
    "$defs": {
        "value": {
            "anyOf": [
                {"type": "string"},
                {"type": "number"},
                {"type": "boolean"},
                {"type": "null"},
                {"type": "array", "items": {"$ref": "#/$defs/value"}},
                {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
            ]
        }
    },
    "type": "object",
    "additionalProperties": {"$ref": "#/$defs/value"},
}

# Keywords whose values are data, not schemas: never walked for strings to bound.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required"})

# Resource limits of one matcher: llguidance's defaults, with grammar size bounded to
# what MAX_GRAMMAR_BYTES can describe.
LIMITS = llguidance.LLParserLimits(max_grammar_size=500_000)


class GrammarError(ValueError):
    """A grammar that cannot be compiled, or a token it does not allow."""


def json_schema_grammar(schema: dict[str, Any] | bool | None) -> str:
    """The grammar of JSON text valid under ``schema`` (None: any JSON object).

    Raises :class:`GrammarError` if ``schema`` is not a JSON object (or a boolean);
    whether it compiles is :func:`check_grammar`'s question.
    """
    if schema is None:
        schema = _ANY_OBJECT
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            bounded_strings(schema),
            overrides=JSON_STYLE,  # type: ignore[arg-type]  # a dict is taken; stub: str
        )
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None


def bounded_strings(schema: Any, limit: int = DEFAULT_MAX_STRING) -> Any:
    """A copy of ``schema`` in which every string subschema with no bound of its own
    (``maxLength``, ``enum``, ``const``, ``pattern`` or ``format``) gets ``maxLength``
    ``limit`` (or its ``minLength``, if larger). Only narrows: what validates against the
    copy validates against ``schema``."""
    if isinstance(schema, list):
        return [bounded_strings(v, limit) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else bounded_strings(v, limit) for k, v in schema.items()}
    kind = schema.get("type")
    is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
    if is_string and not any(
        k in schema for k in ("maxLength", "enum", "const", "pattern", "format")
    ):
        low = schema.get("minLength")
        out["maxLength"] = max(limit, low) if isinstance(low, int) else limit
    return out


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object subschema that lists ``properties``
    and says nothing of others gets ``additionalProperties: false``: a forced call then
    passes only the arguments the function declares. Only narrows, as
    :func:`bounded_strings` does."""
    if isinstance(schema, list):
        return [closed_objects(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else closed_objects(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and not any(
        k in schema for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")
    ):
        out["additionalProperties"] = False
    return out


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark definition (llguidance's dialect: ``%json {...}`` embeds a
    JSON schema)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check_grammar(grammar: str) -> None:
    """Raise :class:`GrammarError` saying why ``grammar`` does not compile (or is too
    large); return if it does. Needs no vocabulary, so the API node checks too."""
    if len(grammar.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the grammar is over {MAX_GRAMMAR_BYTES} bytes")
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=LIMITS)
    if error:
        raise GrammarError(error)

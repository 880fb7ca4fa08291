"""The rules a request field must keep, shared by every dialect's schemas.

A Struct checks its fields in ``__post_init__`` with these; a rule that fails raises
:class:`FieldError`, which msgspec wraps with the JSON path and
:func:`meshd.api.bodies.parse_body` turns into a 400 naming the field (in the
dialect's own error shape).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from meshd.domain.reasoning import ThinkChoice
from meshd.domain.sampling import CHOICE_FIELDS, field_problem
from meshd.engines.detok import MAX_STOPS
from meshd.engines.grammar import GrammarError, check_grammar, json_schema_grammar

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_STOP_SEQUENCES",
    "MAX_TOOLS",
    "FieldError",
    "check_function",
    "check_int64",
    "check_min",
    "check_range",
    "check_sampling_fields",
    "check_stops",
    "schema_grammar",
    "think_choice",
    "unsupported",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

#: Most tools a request may offer (OpenAI's limit, kept for every dialect).
MAX_TOOLS = 128
#: Most stop sequences a request may carry in dialects other than OpenAI's (4).
MAX_STOP_SEQUENCES = MAX_STOPS

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FieldError(ValueError):
    """A request field broke a rule.

    ``param`` is the field's name relative to the Struct that raised (``"temperature"``,
    ``"content"``); the body parser prefixes the JSON path of that Struct. ``code`` is
    the OpenAI error code, ``None`` for a plain invalid value.
    """

    def __init__(self, param: str, reason: str, code: str | None = None) -> None:
        super().__init__(reason)
        self.param = param
        self.reason = reason
        self.code = code


def unsupported(param: str, reason: str) -> FieldError:
    """A field asking for something meshd cannot do (``unsupported_parameter``)."""
    return FieldError(param, reason, code="unsupported_parameter")


def check_range(
    name: str,
    value: float | None,
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
) -> None:
    """``value`` (when sent) lies in [lo, hi] (or (lo, hi])."""
    if value is None:
        return
    # Written as "not (inside)" so that NaN fails too.
    inside = (lo < value if lo_open else lo <= value) and value <= hi
    if not inside:
        left = "(" if lo_open else "["
        raise FieldError(name, f"{name} must be in {left}{lo:g}, {hi:g}], got {value!r}")


def check_min(name: str, value: int | None, lo: int) -> None:
    """``value`` (when sent) is at least ``lo``."""
    if value is not None and value < lo:
        raise FieldError(name, f"{name} must be >= {lo}, got {value}")


def check_int64(req: msgspec.Struct) -> None:
    """Every integer field fits in a signed 64-bit integer.

    JSON integers have no bound and msgspec decodes them into Python ints, but the
    values travel on to the runners in msgpack, which cannot carry more: a ``top_k`` of
    2**70 must be a 400 here, not a failure to encode later.
    """
    for name in req.__struct_fields__:
        value = getattr(req, name)
        if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            raise FieldError(name, f"{name} must fit in a signed 64-bit integer, got {value}")


def check_stops(stops: Sequence[str], name: str = "stop", most: int = MAX_STOP_SEQUENCES) -> None:
    """At most ``most`` stop sequences, none empty."""
    if len(stops) > most:
        raise FieldError(name, f"{name} may hold at most {most} sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise FieldError(name, f"{name} sequences must be non-empty strings")


def schema_grammar(schema: Any, param: str) -> str:
    """The grammar of a JSON Schema (None: any JSON object), or a FieldError naming
    ``param`` that says why the grammar engine cannot compile it."""
    if schema is not None and not isinstance(schema, dict | bool):
        raise FieldError(param, "a JSON Schema is an object")
    try:
        grammar = json_schema_grammar(schema)
        check_grammar(grammar)
    except GrammarError as e:
        raise FieldError(
            param, f"the schema cannot be compiled: {e}", code="invalid_json_schema"
        ) from None
    return grammar


def check_function(name: str, parameters: Any, *, params_field: str = "parameters") -> None:
    """A function a model may call: a name clients and templates can carry, and an
    argument schema the grammar engine compiles (for a forced call)."""
    if not _FUNCTION_NAME.fullmatch(name):
        raise FieldError("name", f"a function name is 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
    if parameters is not None:
        schema_grammar(parameters, params_field)


def check_sampling_fields(body: msgspec.Struct, *, skip: tuple[str, ...] = ()) -> None:
    """Each sampling field ``body`` has (by the sampler's name: ``temperature``,
    ``top_p``...) within its rule; FieldError names the first that is not. ``skip``:
    fields the dialect checks its own way (OpenAI's ``logit_bias`` has string keys)."""
    for name in CHOICE_FIELDS:
        if name in skip or name not in body.__struct_fields__:
            continue
        why = field_problem(name, getattr(body, name))
        if why is not None:
            raise FieldError(name, why)


#: The efforts clients name, as the levels models know (gpt-oss's low, medium, high):
#: OpenAI's ``minimal`` and ``xhigh`` have none of their own; ``none`` is no thinking.
_EFFORTS: dict[str, str | None] = {
    "none": None, "minimal": "low", "low": "low", "medium": "medium", "high": "high",
    "xhigh": "high",
}  # fmt: skip


def think_choice(
    effort: str | None, param: str, *, enabled: bool | None = None, budget: int | None = None
) -> ThinkChoice:
    """How a request wants the model to think: ``effort`` as a client names it (FieldError
    naming ``param`` for a name no level has), thinking ``enabled`` or not (None: the
    model's default), at most ``budget`` thought tokens."""
    if effort is not None and effort not in _EFFORTS:
        raise FieldError(param, f"{param} is one of {', '.join(_EFFORTS)}; got {effort!r}")
    if effort == "none":
        enabled = False
    level = _EFFORTS[effort] if effort is not None else None
    return ThinkChoice(enabled=enabled, budget=budget, effort=level)

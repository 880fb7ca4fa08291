"""How a request samples: what a client or a model names, the values resolved from
them, and the one set of rules every value is checked against.

* :class:`SamplingChoice`: the sampling fields somebody named, None where they said
  nothing: a client's request (each API dialect parses its own names into one) or a
  model's shipped defaults (GGUF ``general.sampling.*``, ``generation_config.json``).
* :class:`Sampling`: the values the last stage uses, from the API node to the sampler
  (:func:`resolve` fills a choice in); it also says when to stop.
* :func:`field_problem`: the rule of each field, the only place a range is written.
  A dialect checks what its client sent with it (naming its own field), the API node
  checks the resolved values, stage 0 checks a Generate from any member again
  (``bad_sampling``), and a model's defaults that break it are not taken.

A field nobody names takes, in this order, the model's own default, then
:data:`SERVER_DEFAULTS` (llama.cpp's server's: temperature 0.8, top_k 40, top_p 0.95,
min_p 0.05, repeat_penalty 1, which suit small local models; at temperature 1 over the
whole vocabulary they read as word salad). ``presence_penalty`` and
``frequency_penalty`` default to 0 and ``logit_bias`` to none, as OpenAI's do.
``temperature: 0`` is greedy: the filters cannot change the most likely token.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import msgspec

from .reasoning import Thinking

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_PENALTY",
    "MAX_REPEAT_PENALTY",
    "MAX_TEMPERATURE",
    "MAX_TOP_LOGPROBS",
    "SERVER_DEFAULTS",
    "Sampling",
    "SamplingChoice",
    "SamplingError",
    "field_problem",
    "resolve",
]

#: OpenAI's upper bound for ``temperature``.
MAX_TEMPERATURE = 2.0
#: OpenAI's bound (either sign) for ``presence_penalty`` and ``frequency_penalty``.
MAX_PENALTY = 2.0
#: Upper bound for llama.cpp's ``repeat_penalty`` (past it every repeat is banned).
MAX_REPEAT_PENALTY = 10.0
#: OpenAI's bound (either sign) for a ``logit_bias`` value: -100 bans, +100 forces.
MAX_LOGIT_BIAS = 100.0
#: Most tokens one ``logit_bias`` may name (OpenAI documents no limit; this bounds
#: the work per token).
MAX_LOGIT_BIAS_ENTRIES = 1024
#: Most alternatives a token's log-probability may come with (OpenAI's ``top_logprobs``).
MAX_TOP_LOGPROBS = 20


class SamplingError(ValueError):
    """A sampling value broke its rule; ``field`` names it (the sampler's name)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _number(value: object) -> float | None:
    """``value`` as a finite float, or None (not a number, a bool, NaN or infinite)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def _integer(value: object) -> int | None:
    """``value`` as an int, or None (not an integer, or a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _in(lo: float, hi: float, lo_open: bool = False) -> Callable[[object], bool]:
    def ok(value: object) -> bool:
        x = _number(value)
        return x is not None and (lo < x if lo_open else lo <= x) and x <= hi

    return ok


def _at_least(lo: int, hi: int | None = None) -> Callable[[object], bool]:
    def ok(value: object) -> bool:
        n = _integer(value)
        return n is not None and n >= lo and (hi is None or n <= hi)

    return ok


_P = MAX_PENALTY
#: Each field's rule and what its breach says (``{v}``: the value given).
_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "temperature": (
        _in(0.0, MAX_TEMPERATURE),
        f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {{v}}",
    ),
    "top_p": (_in(0.0, 1.0, lo_open=True), "top_p must be a number in (0, 1] (1 = off), got {v}"),
    "top_k": (_at_least(0), "top_k must be an integer >= 0 (0 = off), got {v}"),
    "min_p": (_in(0.0, 1.0), "min_p must be a number in [0, 1] (0 = off), got {v}"),
    "presence_penalty": (
        _in(-_P, _P),
        f"presence_penalty must be a number in [-{_P:g}, {_P:g}] (0 = off), got {{v}}",
    ),
    "frequency_penalty": (
        _in(-_P, _P),
        f"frequency_penalty must be a number in [-{_P:g}, {_P:g}] (0 = off), got {{v}}",
    ),
    "repeat_penalty": (
        _in(0.0, MAX_REPEAT_PENALTY, lo_open=True),
        f"repeat_penalty must be a number in (0, {MAX_REPEAT_PENALTY:g}] (1 = off), got {{v}}",
    ),
    "repeat_last_n": (
        _at_least(-1),
        "repeat_last_n must be an integer >= -1 (-1 = every generated token, 0 = off), got {v}",
    ),
    "seed": (lambda v: _integer(v) is not None, "seed must be an integer or None, got {v}"),
    "logprobs": (
        _at_least(0, MAX_TOP_LOGPROBS),
        f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {{v}}",
    ),
    "max_tokens": (_at_least(1), "max_tokens must be an integer >= 1, got {v}"),
}


def _bias_problem(bias: object) -> str | None:
    if not isinstance(bias, dict):
        return "logit_bias must map token ids to numbers"
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        return f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}"
    in_range = _in(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    for tok, value in bias.items():
        if not _at_least(0)(tok):
            return f"logit_bias keys must be token ids >= 0, got {tok!r}"
        if not in_range(value):
            return (
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {tok}"
            )
    return None


def field_problem(name: str, value: object) -> str | None:
    """What is wrong with ``value`` for the sampling field ``name`` (None: nothing;
    a value of None, not named, is never wrong)."""
    if value is None:
        return None
    if name == "logit_bias":
        return _bias_problem(value)
    ok, why = _RULES[name]
    return None if ok(value) else why.format(v=repr(value))


#: The fields a client or a model may name (every one has a rule in field_problem).
CHOICE_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repeat_penalty", "repeat_last_n", "logit_bias", "seed",
)  # fmt: skip


class SamplingChoice(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Sampling fields somebody named (a client's request, a model's shipped
    defaults); None where they said nothing."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    #: Token id -> value added to its logit.
    logit_bias: dict[int, float] = {}
    seed: int | None = None

    def problems(self) -> list[SamplingError]:
        """Every named field that breaks its rule."""
        out = []
        for name in CHOICE_FIELDS:
            why = field_problem(name, getattr(self, name))
            if why is not None:
                out.append(SamplingError(name, why))
        return out

    def sane(self) -> SamplingChoice:
        """This choice without the fields that break their rule (a model file's
        defaults are its authors' word, not the client's: a bad one is not taken)."""
        bad = {e.field for e in self.problems()}
        if not bad:
            return self
        return msgspec.structs.replace(
            self, **{name: ({} if name == "logit_bias" else None) for name in bad}
        )


class Sampling(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the last stage picks tokens and when it stops: every value resolved (see
    :func:`resolve`). The defaults here are plain sampling at T=1, each filter off.

    ``temperature`` 0 means greedy (argmax). ``top_k`` 0, ``top_p`` 1, ``min_p`` 0,
    penalties 0 and ``repeat_penalty`` 1 are off. ``repeat_last_n`` -1 counts every
    token generated so far. ``seed`` None draws from fresh OS entropy; an int makes the
    draws reproducible. Values are not checked at construction or decoding (a Generate
    from any member must get a typed ``bad_sampling`` answer, not be dropped as
    malformed): :meth:`check` does, and the sampler checks what it is given.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    #: Token id -> value added to its logit.
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    #: None: until end of sequence or the context is full.
    max_tokens: int | None = None
    stop: list[str] = []
    #: Keep going past end-of-sequence tokens (until max_tokens or the context ends).
    ignore_eos: bool = False
    #: Send each token's log-probability and this many alternatives' (None: none).
    logprobs: int | None = None
    #: Constrain the output to this grammar (llguidance's JSON definition, see
    #: ``meshd.engines.grammar``); None: free text.
    grammar: str | None = None
    #: Control tokens the text shows as their own text, where other control tokens
    #: show as nothing: the markers of the model's tool-call format, which the API
    #: node reads calls by (stage 0 sets them for a request with tools).
    shown_specials: list[int] = []
    #: The request's thoughts, where the model thinks (stage 0 sets them up).
    thinking: Thinking | None = None
    #: Tokens the output starts with, put there in place of sampled ones (stage 0
    #: sets them: the thoughts' open marker when a grammar waits for their end).
    forced: list[int] = []

    def check(self, n_vocab: int = 0) -> None:
        """Raise :class:`SamplingError` for the first value that breaks its rule, or a
        biased token past a vocabulary of ``n_vocab`` (0: not known)."""
        for name in (*CHOICE_FIELDS, "logprobs", "max_tokens"):
            why = field_problem(name, getattr(self, name))
            if why is not None:
                raise SamplingError(name, why)
        if n_vocab and self.logit_bias and max(self.logit_bias) >= n_vocab:
            raise SamplingError(
                "logit_bias",
                f"logit_bias names token {max(self.logit_bias)}; the vocabulary has {n_vocab}",
            )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (no randomness is consumed)."""
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """True when the tokens generated so far change the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or (self.repeat_penalty != 1.0 and self.repeat_last_n != 0)
        )


#: What a request gets for a field neither it nor its model names (llama-server's).
SERVER_DEFAULTS = SamplingChoice(
    temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64
)


def resolve(
    asked: SamplingChoice,
    model: SamplingChoice | None,
    *,
    max_tokens: int | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    grammar: str | None = None,
) -> Sampling:
    """The values to sample with: what ``asked`` names, else the ``model``'s default,
    else :data:`SERVER_DEFAULTS`; with when to stop and what to report."""
    sources = [asked, model or SamplingChoice(), SERVER_DEFAULTS]

    def pick(name: str) -> float | int:
        for source in sources:
            value = getattr(source, name)
            if value is not None:
                return value  # type: ignore[no-any-return]  # a Struct field, read by name
        raise AssertionError(name)  # SERVER_DEFAULTS names every field it is asked for

    return Sampling(
        temperature=float(pick("temperature")),
        top_p=float(pick("top_p")),
        top_k=int(pick("top_k")),
        min_p=float(pick("min_p")),
        repeat_penalty=float(pick("repeat_penalty")),
        repeat_last_n=int(pick("repeat_last_n")),
        presence_penalty=asked.presence_penalty or 0.0,
        frequency_penalty=asked.frequency_penalty or 0.0,
        logit_bias=dict(asked.logit_bias),
        seed=asked.seed,
        max_tokens=max_tokens,
        stop=list(stop or []),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        grammar=grammar,
    )

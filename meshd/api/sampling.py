"""How a request samples: what it names, filled in with documented defaults.

Every dialect parses its own field names into one :class:`SamplingRequest` (``None`` for
each field the client did not send); :func:`pipeline_sampling` turns it into the values
the last stage uses. A field the client did not send takes, in this order:

1. the model's own default, when its file ships one (GGUF ``general.sampling.*`` or
   the ``generation_config.json`` of an MLX folder; see ``meshd.models.generation``);
2. :data:`SERVER_DEFAULTS`, llama.cpp's server's: temperature 0.8, top_k 40, top_p
   0.95, min_p 0.05, repeat_penalty 1 (off). These suit small local models, which
   read as word salad when sampled at temperature 1 from the whole vocabulary.

Penalties that OpenAI defines (``presence_penalty``, ``frequency_penalty``) default to 0
and ``logit_bias`` to none, as OpenAI's do. ``temperature: 0`` is greedy: the filters
cannot change the most likely token, so it stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshd.crdt.views import ModelFacts, SamplingDefaults
from meshd.transport import wire

from .errors import ApiError, bad_request

__all__ = ["SERVER_DEFAULTS", "SamplingRequest", "check_max_tokens", "pipeline_sampling"]

#: What a request gets for a field neither it nor its model names (llama-server's).
SERVER_DEFAULTS = SamplingDefaults(
    temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64
)


@dataclass(frozen=True, kw_only=True)
class SamplingRequest:
    """The sampling fields a client sent, in no dialect (None: not sent)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    #: Token id -> value added to its logit.
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None


def check_max_tokens(max_tokens: int | None, cap: int, param: str = "max_tokens") -> int:
    """``max_tokens`` as the pipeline takes it: over ``cap`` is a 400 naming ``param``
    (the dialect's name for it), none means ``cap``."""
    if max_tokens is not None and max_tokens > cap:
        raise bad_request(
            f"{param} is too large: {max_tokens}. This node generates at most "
            f"{cap} tokens per request (meshd up --max-tokens).",
            param=param,
            code="max_tokens_too_large",
        )
    return cap if max_tokens is None else max_tokens


def pipeline_sampling(
    s: SamplingRequest,
    facts: ModelFacts | None,
    *,
    max_tokens: int,
    stop: list[str],
    ignore_eos: bool = False,
    logprobs: int | None = None,
    grammar: str | None = None,
) -> wire.Sampling:
    """The values the last stage samples with (see the module doc for the defaults).

    A ``logit_bias`` token past the model's vocabulary is a 400 naming ``logit_bias``.
    """
    model = facts.sampling if facts is not None and facts.sampling else SamplingDefaults()
    n_vocab = facts.n_vocab if facts is not None else 0
    if n_vocab and s.logit_bias:
        past = max(s.logit_bias)
        if past >= n_vocab:
            raise _bad_bias(past, n_vocab)

    def pick(name: str) -> float | int:
        for source in (s, model, SERVER_DEFAULTS):
            value = getattr(source, name)
            if value is not None:
                return value
        raise AssertionError(name)  # SERVER_DEFAULTS names every field

    return wire.Sampling(
        temperature=float(pick("temperature")),
        top_p=float(pick("top_p")),
        top_k=int(pick("top_k")),
        min_p=float(pick("min_p")),
        repeat_penalty=float(pick("repeat_penalty")),
        repeat_last_n=int(pick("repeat_last_n")),
        presence_penalty=s.presence_penalty or 0.0,
        frequency_penalty=s.frequency_penalty or 0.0,
        logit_bias=dict(s.logit_bias),
        seed=s.seed,
        max_tokens=max_tokens,
        stop=stop,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        grammar=grammar,
    )


def _bad_bias(token: int, n_vocab: int) -> ApiError:
    return bad_request(
        f"logit_bias names token {token}, but this model's vocabulary has {n_vocab} tokens "
        f"(ids 0 to {n_vocab - 1})",
        param="logit_bias",
        code="invalid_logit_bias",
    )

"""A request's sampling at the API: what its dialect's fields name checked against the
one set of rules (:func:`meshd.domain.sampling.field_problem`), and the values the
pipeline samples with resolved from them (:func:`meshd.domain.sampling.resolve`: the
client's value, else the model's own default, else the server's).

Every dialect parses its own field names into one
:class:`~meshd.domain.sampling.SamplingChoice` (None for each field not sent).
"""

from __future__ import annotations

from meshd.domain.facts import ModelFacts
from meshd.domain.sampling import Sampling, SamplingChoice, resolve

from .errors import ApiError, bad_request

__all__ = ["check_max_tokens", "pipeline_sampling"]


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
    s: SamplingChoice,
    facts: ModelFacts | None,
    *,
    max_tokens: int,
    stop: list[str],
    ignore_eos: bool = False,
    logprobs: int | None = None,
    grammar: str | None = None,
) -> Sampling:
    """The values the last stage samples with (:func:`resolve`). A ``logit_bias``
    token past the model's vocabulary is a 400 naming ``logit_bias``."""
    n_vocab = facts.n_vocab if facts is not None else 0
    if n_vocab and s.logit_bias:
        past = max(s.logit_bias)
        if past >= n_vocab:
            raise _bad_bias(past, n_vocab)
    model = facts.sampling if facts is not None else None
    return resolve(
        s, model, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos,
        logprobs=logprobs, grammar=grammar,
    )  # fmt: skip


def _bad_bias(token: int, n_vocab: int) -> ApiError:
    return bad_request(
        f"logit_bias names token {token}, but this model's vocabulary has {n_vocab} tokens "
        f"(ids 0 to {n_vocab - 1})",
        param="logit_bias",
        code="invalid_logit_bias",
    )

"""What a request asks of a model, whatever plan runs it."""

from __future__ import annotations

from typing import Any

import msgspec

from .chat import ChatTurn, ToolUse
from .reasoning import ThinkChoice
from .sampling import Sampling

__all__ = ["Job"]


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """What a request asks of a model, whatever the plan that runs it: the fields of
    :class:`Generate` that the API node decides (exactly one of ``messages``,
    ``prompt`` and ``prompt_tokens`` is set)."""

    messages: list[ChatTurn] | None = None
    prompt: str | None = None
    #: A prompt already tokenized (an embeddings input given as token ids).
    prompt_tokens: list[int] | None = None
    sampling: Sampling = Sampling()
    tools: ToolUse | None = None
    #: The input's embedding, not a continuation: the last stage pools its final
    #: hidden states into one vector.
    embed: bool = False
    #: Only count the prompt's tokens: stage 0 answers with ``n_prompt`` and a finish,
    #: and runs nothing (Anthropic's ``count_tokens``).
    count_only: bool = False
    #: Whether stage 0 may start from the KV of an earlier request whose tokens begin
    #: the same way (the prefix cache). None: yes, as llama.cpp's server does; False
    #: computes the whole prompt on a cold runner (every stage's kept prefixes dropped),
    #: as :attr:`exact` does. A reused prefix moves the low bits of the logits, so a
    #: near-tie may flip between a warm and a cold run.
    cache_prompt: bool | None = None
    #: Whether stage 0 drafts tokens by prompt lookup for the last stage to verify in
    #: one pass (speculative decoding). None: as the instance says, else on a split
    #: instance (a verified batch of rows sums in another order than one row a step,
    #: and on one node the extra rows cost about what they save).
    speculate: bool | None = None
    #: The exact mode (:mod:`meshd.domain.exact`): no fast path that may move the low
    #: bits (no prefix reuse, no speculation, whatever the two above say), so the same
    #: request gives the same tokens whatever ran before. None: as its instance says
    #: (the API node settles it before it sends the job).
    exact: bool | None = None
    #: Who asked, as the API node tells its clients apart (a hash of the API key,
    #: else the address): stage 0's queue takes turns between clients, so one client's
    #: many requests do not hold back another's few ("": a client of its own).
    client: str = ""
    #: How the model should think (a model that does not think ignores it).
    think: ThinkChoice = ThinkChoice()
    #: More variables for the chat template (OpenAI-compatible servers'
    #: ``chat_template_kwargs``); the names the template is always given are not taken.
    template_kwargs: dict[str, Any] = {}

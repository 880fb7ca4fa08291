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
    #: the same way (the prefix cache). None: a sampled request without a seed may; a
    #: greedy or seeded one computes its whole prompt, so that the same request gives
    #: the same answer whatever ran before (a reused prefix moves the low bits).
    cache_prompt: bool | None = None
    #: Whether stage 0 drafts tokens by prompt lookup for the last stage to verify in
    #: one pass (speculative decoding). None: a sampled request without a seed on a
    #: split instance does (a verified batch of rows sums in another order than one
    #: row a step, and on one node the extra rows cost about what they save).
    speculate: bool | None = None
    #: Who asked, as the API node tells its clients apart (a hash of the API key,
    #: else the address): stage 0's queue takes turns between clients, so one client's
    #: many requests do not hold back another's few ("": a client of its own).
    client: str = ""
    #: How the model should think (a model that does not think ignores it).
    think: ThinkChoice = ThinkChoice()
    #: More variables for the chat template (OpenAI-compatible servers'
    #: ``chat_template_kwargs``); the names the template is always given are not taken.
    template_kwargs: dict[str, Any] = {}

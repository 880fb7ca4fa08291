"""Thinking: what a request asks of a model that reasons before it answers, and what
stage 0 tells the last stage about a request's thoughts."""

from __future__ import annotations

import msgspec

__all__ = ["ThinkChoice", "Thinking"]


class ThinkChoice(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a request wants the model to think; None where it said nothing (the model
    thinks as its template says by default: on, for the models that think)."""

    #: False turns thinking off with the model's own switch; True turns it on.
    enabled: bool | None = None
    #: Most tokens the thoughts may take: at the budget the last stage closes them
    #: with the model's own close marker, and the answer follows.
    budget: int | None = None
    #: ``low``, ``medium`` or ``high`` (gpt-oss's ``Reasoning:`` line).
    effort: str | None = None


class Thinking(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request's thoughts as stage 0 set them up (it read the model's template and
    rendered the prompt): the last stage splits the output by them, counts them, and
    starts a grammar only after them."""

    #: How the model marks its thoughts (``meshd.models.reasoning.ReasoningFormat``).
    format: str
    #: The prompt ended inside the thoughts: the output starts with them.
    open: bool = False
    #: The model thinks for sure: a grammar waits for the thoughts to end. Otherwise
    #: (thinking turned off, or a template with no switch, whose model may not think
    #: at all) a grammar holds from the first token.
    on: bool = True
    #: Most thought tokens (None: no cap).
    budget: int | None = None
    #: The close marker's tokens, put in the output at the budget.
    close: list[int] = []
    #: Tokens put in the output after the thoughts where the model would write them
    #: itself: after a budget's close, and before a grammar starts (gpt-oss's header
    #: of the message that follows its thoughts).
    answer: list[int] = []

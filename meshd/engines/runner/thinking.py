"""A request's thoughts at the last stage: its output split into thoughts and answer
as it streams, its thought tokens counted and capped, and a grammar held back until
the thoughts end.

Stage 0 read the model's template and rendered the prompt, so it says how the output
thinks (``Sampling.thinking``): the format, whether the output starts inside the
thoughts, the budget, and the tokens of the model's own markers. Here one
:class:`~meshd.models.reasoning.ReasoningParser` reads the text of each token as it is
made; its thoughts travel apart from the answer (``DataChunk.reasoning``), so every
dialect shows them its own way and the tool-call parser reads the answer only.

Some tokens are put in the output rather than sampled (:meth:`ThoughtTrack.forced`):
what stage 0 forced at the start (the open marker, when a grammar waits and the
prompt does not open the thoughts, so that the model does think first), the close
marker once the thoughts reach their budget, and the header that must follow the
thoughts before a grammar starts (gpt-oss's). A grammar (a JSON schema, a forced
call) applies to the answer: it starts with the first token after all of those.

Stage 0's side is :class:`ThinkSetup`: the template's variables and soft switch that
turn thinking on or off, the prompt closed where it opens the thoughts and thinking is
off, and the :class:`~meshd.domain.reasoning.Thinking` it sends on.

``$MESHD_TEST_SCRIPT`` is a test drill, read by runners only (as
``$MESHD_FAULT_INJECT``): set to a marker, a chat whose last user turn starts with that
marker gets the rest of the turn (special tokens parsed) as the first tokens of its
output, in place of sampled ones, so that tests see a model think in a known way.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshd.domain.chat import ChatTurn
from meshd.domain.job import Job
from meshd.domain.reasoning import Thinking
from meshd.engines.constraint import Constraint
from meshd.models.chat import template_variables
from meshd.models.reasoning import (
    HARMONY_ANALYSIS,
    HARMONY_END,
    HARMONY_FINAL,
    HARMONY_START,
    LOWEST_EFFORT,
    TAGS,
    ReasoningParser,
    close_thoughts,
    opens_thoughts,
    reasoning_format,
    reasoning_markers,
    soft_switched,
    thinking_switch,
)
from meshd.models.tools import control_tokens

__all__ = ["SCRIPT_ENV", "Rendered", "ThinkSetup", "ThoughtTrack"]

#: The test drill's variable (see the module's text).
SCRIPT_ENV = "MESHD_TEST_SCRIPT"
#: What every template is given already: a client's template variables do not replace it.
_RESERVED = frozenset(
    {
        "template",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
    }
)

Tokenize = Callable[[str], Sequence[int]]


@dataclass
class Rendered:
    """What rendering one chat prompt settled about its thoughts."""

    #: The template's variables for it (the client's, and the thinking switch).
    variables: dict[str, Any] = field(default_factory=dict)
    #: The prompt ends inside the thoughts: the output starts with them.
    open: bool = False
    #: The model thinks for sure (a switch on, a prompt that opens the thoughts,
    #: gpt-oss), so a grammar waits for its thoughts to end.
    on: bool = True
    #: Tokens the output starts with (the test drill's script).
    script: list[int] = field(default_factory=list)


class ThinkSetup:
    """A model's thinking as stage 0 sets it up for each request: its format and
    switch (read once from the template), and its markers' tokens."""

    def __init__(
        self,
        template: str | None,
        tokenize: Tokenize,
        piece: Callable[[int, bool], bytes],
    ) -> None:
        """``tokenize``: text to tokens, special tokens parsed; ``piece(id, special)``:
        a token's bytes (its text only when ``special``, for a control token)."""
        self.format = reasoning_format(template)
        variables = template_variables(template) if template else frozenset()
        self.switch = thinking_switch(template, variables)
        #: The markers that are control tokens of the model (the output shows them).
        self.specials = (
            control_tokens(reasoning_markers(self.format), tokenize, piece) if self.format else {}
        )
        self._tokenize = tokenize
        self._script = os.environ.get(SCRIPT_ENV, "")

    def render(self, job: Job, turns: Sequence[ChatTurn], quote: Callable[[Any], Any]) -> Rendered:
        """The template's variables for ``job``'s thinking (``quote``: the special-token
        quoting every client string gets) and the drill's script, before rendering."""
        out = Rendered(variables=dict(quote({k: v for k, v in job.template_kwargs.items()
                                             if k not in _RESERVED})))  # fmt: skip
        sw, think = self.switch, job.think
        enabled = think.enabled
        if sw.variable is not None:
            given = out.variables.get(sw.variable)
            if isinstance(given, bool):
                enabled = given  # a client's own chat_template_kwargs switch
            out.variables[sw.variable] = enabled is not False
        if sw.effort is not None and sw.effort not in out.variables:
            effort = think.effort or (LOWEST_EFFORT if enabled is False else None)
            if effort is not None:
                out.variables[sw.effort] = effort
        # gpt-oss always thinks; a template's switch says when the others do (and
        # settle() adds a prompt that opens the thoughts). A template with no switch
        # leaves it to the model, which may not think at all (Qwen3-Instruct-2507's
        # still strips <think> from history): a grammar then holds from the first token.
        out.on = self.format == "harmony" or (sw.variable is not None and enabled is not False)
        last = turns[-1] if turns else None
        if self._script and last is not None and last.content.startswith(self._script):
            out.script = self._tokens(last.content[len(self._script) :])
        return out

    def soft_off(
        self, job: Job, rendered: Rendered, messages: Sequence[Mapping[str, Any]]
    ) -> Sequence[Mapping[str, Any]]:
        """``messages`` with the soft switch where thinking is off by it."""
        sw = self.switch
        if job.think.enabled is False and sw.variable is None and self.format != "harmony":
            return soft_switched(messages, sw) or messages
        return messages

    def settle(self, job: Job, rendered: Rendered, prompt: str) -> str:
        """The rendered ``prompt``, closed where it opens the thoughts and thinking is
        off; ``rendered`` learns whether the output starts inside them."""
        fmt = self.format
        if fmt is None or fmt == "harmony":
            return prompt
        rendered.open = opens_thoughts(prompt, fmt)
        if rendered.open and job.think.enabled is False and self.switch.variable is None:
            rendered.open, rendered.on = False, False
            return close_thoughts(prompt, fmt)
        if rendered.open:
            rendered.on = True  # the template opened them: the model thinks
        return prompt

    def thinking(self, job: Job, rendered: Rendered, grammar: str | None) -> Thinking | None:
        """What the last stage needs of ``job``'s thoughts (None: the model does not
        think, or the job is no chat); ``grammar``: ``tool`` for a forced call, ``json``
        for the client's grammar, None for none."""
        fmt = self.format
        if fmt is None or job.messages is None:
            return None
        if fmt == "harmony":
            # After its thoughts gpt-oss writes the next message's header: a call's
            # (which the grammar of a forced call writes from its channel on) or the
            # final answer's.
            close = self._tokens(HARMONY_END)
            answer = HARMONY_START + "assistant" + ("" if grammar == "tool" else HARMONY_FINAL)
            after = self._tokens(answer)
        else:
            close, after = self._tokens(TAGS[fmt].close + "\n\n"), []
        return Thinking(format=fmt, open=rendered.open, on=rendered.on,
                        budget=job.think.budget, close=close, answer=after)  # fmt: skip

    def opener(self, thinking: Thinking | None, grammar: str | None) -> list[int]:
        """The tokens to start the output with so that the model thinks before a
        grammar holds it (none where the prompt opened the thoughts, or none waits)."""
        if thinking is None or grammar is None or not thinking.on or thinking.open:
            return []
        if thinking.format == "harmony":
            return self._tokens(HARMONY_ANALYSIS)
        return self._tokens(TAGS[thinking.format].open + "\n")  # type: ignore[index]  # stage 0's own format

    def _tokens(self, text: str) -> list[int]:
        return list(self._tokenize(text))


class ThoughtTrack:
    """One request's thoughts at the last stage (see the module's text)."""

    def __init__(
        self, thinking: Thinking | None, forced: Sequence[int], grammar: Constraint | None
    ) -> None:
        """``thinking``: how the output thinks (None: the model does not); ``forced``:
        the tokens the output starts with; ``grammar``: a grammar that waits for the
        thoughts to end (None: none waits)."""
        self.thinking = thinking
        self.parser: ReasoningParser | None = None
        if thinking is not None:
            self.parser = ReasoningParser(thinking.format, open=thinking.open)
        self._queue = deque(forced)
        self._grammar = grammar
        self._closed = False  # the budget's close is queued
        self._answered = False  # the tokens before the answer are queued
        #: Tokens of the thoughts so far (their markers included).
        self.n_thoughts = 0

    def forced(self) -> int | None:
        """The next token to put in the output in place of a sampled one, if any."""
        return self._queue.popleft() if self._queue else None

    def split(self, text: str) -> tuple[str, str]:
        """The thoughts and the answer text settled by one more token's ``text``
        (each call is one token: it is counted, and the budget checked)."""
        p = self.parser
        if p is None:
            return "", text
        was = p.thinking
        thoughts, answer = p.feed(text)
        if was or p.thinking or thoughts:
            self.n_thoughts += 1
        t = self.thinking
        assert t is not None  # a parser is made for thinking only
        if p.thinking and t.budget is not None and self.n_thoughts >= t.budget and not self._closed:
            # The model's own close marker ends its thoughts; the answer follows.
            self._closed = self._answered = True
            self._queue.extend(t.close)
            self._queue.extend(t.answer)
        return thoughts, answer

    def finish(self, text: str = "") -> tuple[str, str]:
        """The thoughts and answer text of ``text`` (the stream's last, held back: no
        token of its own) and of what is still held, once the output has ended."""
        if self.parser is None:
            return "", text
        thoughts, answer = self.parser.feed(text)
        more, rest = self.parser.finish()
        return thoughts + more, answer + rest

    def grammar_now(self) -> Constraint | None:
        """The waiting grammar, once it starts (after the token :meth:`split` just
        read): the thoughts are over and nothing is left to put in first; else None."""
        if self._grammar is None or self._queue:
            return None
        if self.parser is not None and not self.parser.ended:
            return None
        t = self.thinking
        if t is not None and t.answer and not self._answered:
            self._answered = True
            self._queue.extend(t.answer)
            return None
        grammar, self._grammar = self._grammar, None
        return grammar

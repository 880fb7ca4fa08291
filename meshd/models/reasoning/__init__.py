"""Reasoning as models write it: how a model marks its thoughts (told from its chat
template), how a request turns them on or off with the model's own switch, and how
its output is split into thoughts and answer as it streams.

* :func:`reasoning_format` reads the format from a template: ``think``
  (``<think>...</think>``: Qwen3, DeepSeek-R1, GLM-4.5, SmolLM3, ...), ``seed``,
  ``magistral`` (``[THINK]``), ``command_r7b`` (``<|START_THINKING|>``) or
  ``harmony`` (gpt-oss: an ``analysis`` message, then a ``final`` one);
* :func:`thinking_switch` reads what the template offers to turn thinking off or set
  its effort (:mod:`.switches`); :func:`opens_thoughts` tells a prompt that opens the
  thoughts itself, so the output starts inside them;
* :class:`ReasoningParser` splits the output, chunk-boundary safe, once per request.
"""

from .formats import (
    HARMONY_ANALYSIS,
    HARMONY_END,
    HARMONY_FINAL,
    HARMONY_START,
    TAGS,
    ReasoningFormat,
    Tags,
    reasoning_format,
    reasoning_markers,
)
from .parser import ReasoningParser
from .switches import (
    EFFORTS,
    LOWEST_EFFORT,
    Switch,
    close_thoughts,
    opens_thoughts,
    soft_switched,
    thinking_switch,
)

__all__ = [
    "EFFORTS",
    "HARMONY_ANALYSIS",
    "HARMONY_END",
    "HARMONY_FINAL",
    "HARMONY_START",
    "LOWEST_EFFORT",
    "TAGS",
    "ReasoningFormat",
    "ReasoningParser",
    "Switch",
    "Tags",
    "close_thoughts",
    "opens_thoughts",
    "reasoning_format",
    "reasoning_markers",
    "soft_switched",
    "thinking_switch",
]

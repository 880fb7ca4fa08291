"""How a model marks its thoughts, told from its chat template.

Most families write their thoughts between two tags before the answer; which tags,
the template shows (it strips them from earlier answers, or opens them in the
generation prompt). gpt-oss writes harmony messages instead: its thoughts are an
``analysis`` message, its answer a ``final`` one.

The name travels on the wire (``Thinking.format``), from stage 0, which read the
template, to the last stage, which splits the output: names are kept as they are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "HARMONY_ANALYSIS",
    "HARMONY_END",
    "HARMONY_FINAL",
    "HARMONY_START",
    "TAGS",
    "ReasoningFormat",
    "Tags",
    "reasoning_format",
    "reasoning_markers",
]

ReasoningFormat = Literal["think", "seed", "magistral", "command_r7b", "harmony"]


@dataclass(frozen=True)
class Tags:
    """The markers around a family's thoughts."""

    open: str
    close: str


#: The tag formats (every format but harmony).
TAGS: dict[ReasoningFormat, Tags] = {
    # Qwen3, DeepSeek-R1 and its distills, GLM-4.5, SmolLM3, Granite 3.3, Hunyuan...
    "think": Tags("<think>", "</think>"),
    "seed": Tags("<seed:think>", "</seed:think>"),
    "magistral": Tags("[THINK]", "[/THINK]"),
    "command_r7b": Tags("<|START_THINKING|>", "<|END_THINKING|>"),
}

#: Harmony's pieces (gpt-oss): the header that opens its thoughts, the one that opens
#: its answer after them, and the tokens around a message.
HARMONY_START, HARMONY_END = "<|start|>", "<|end|>"
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>"
HARMONY_FINAL = "<|channel|>final<|message|>"
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")


def _has(*telltales: str) -> Callable[[str], bool]:
    return lambda template: any(t in template for t in telltales)


# The first match wins: a template that speaks harmony may also mention tags in its
# text; Seed's and Command R7B's tags hold "think" too.
_DETECT: tuple[tuple[Callable[[str], bool], ReasoningFormat], ...] = (
    (_has("<|channel|>"), "harmony"),
    (_has("<seed:think>", "</seed:think>"), "seed"),
    (_has("<|START_THINKING|>", "<|END_THINKING|>"), "command_r7b"),
    (_has("[THINK]", "[/THINK]"), "magistral"),
    (_has("<think>", "</think>"), "think"),
)


def reasoning_format(template: str | None) -> ReasoningFormat | None:
    """How the model of this chat template marks its thoughts (None: it writes none)."""
    if not template:
        return None
    for matches, fmt in _DETECT:
        if matches(template):
            return fmt
    return None


def reasoning_markers(fmt: ReasoningFormat) -> tuple[str, ...]:
    """The markers of ``fmt`` that the output must show as text where they are control
    tokens of the model (the last stage renders those tokens so, to split by them)."""
    if fmt == "harmony":
        return _HARMONY_MARKERS
    tags = TAGS[fmt]
    return (tags.open, tags.close)

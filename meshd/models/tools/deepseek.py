"""DeepSeek V3 / R1 and V3.1: calls between the model's own markers (note the
full-width bars and the ``▁``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>            (V3, R1)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
                                                       (V3.1)

The reader takes both shapes; each model's forced call is its own."""

from __future__ import annotations

from .base import BlockReader, Part, Tools, loads, named_call, section
from .grammar import LarkMaker, Marks, json_rule, lit, parameters, picked

__all__ = ["DEEPSEEK_MARKERS", "deepseek_lark", "deepseek_reader"]

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
#: The markers, each one token of a DeepSeek vocabulary.
DEEPSEEK_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)


def _arguments(text: str) -> object:
    """The arguments' JSON, with or without a ```json fence around it."""
    text = text.strip()
    if text.startswith("```"):
        text = text.removeprefix("```").removeprefix("json").removesuffix("```")
    return loads(text)


def _call(text: str, final: bool) -> tuple[int, list[Part]] | None:
    end = text.find(CALL_END)
    if end < 0 and not final:
        return None
    n = len(text) if end < 0 else end + len(CALL_END)
    kind, sep, rest = text[len(CALL_BEGIN) : end if end >= 0 else n].partition(SEP)
    call = None
    if sep and kind.strip() == "function" and not rest.lstrip().startswith("{"):
        name, _, args = rest.partition("\n")  # V3 / R1: the name, then fenced JSON
        call = named_call(name, _arguments(args))
    elif sep:  # V3.1: the name, then the JSON
        call = named_call(kind, _arguments(rest))
    return n, [call if call is not None else text[:n]]


def deepseek_reader(tools: Tools) -> BlockReader:
    """A reader of DeepSeek's calls (V3, R1 and V3.1 shapes alike)."""
    return BlockReader(
        [CALLS_BEGIN, CALL_BEGIN], section(CALLS_BEGIN, CALLS_END, CALL_BEGIN, _call)
    )


def deepseek_lark(fenced: bool) -> LarkMaker:
    """The grammar maker of one call: V3/R1's typed and fenced shape when ``fenced``,
    else V3.1's."""

    def lark(tools: Tools, name: str | None, marks: Marks) -> str:
        calls, rules = [], []
        for i, t in enumerate(picked(tools, name)):
            args = json_rule(parameters(t))
            if fenced:
                title = lit(t["name"] + "\n```json\n")
                body = f'"function" {marks(SEP)} {title} {args} "\\n```"'
            else:
                body = f"{lit(t['name'])} {marks(SEP)} {args}"
            rules.append(f"c{i}: {body}")
            calls.append(f"c{i}")
        head = f"start: {marks(CALLS_BEGIN)} {marks(CALL_BEGIN)} ({' | '.join(calls)})"
        return "\n".join([f"{head} {marks(CALL_END)} {marks(CALLS_END)}", *rules]) + "\n"

    return lark

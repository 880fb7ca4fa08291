"""Thoughts told apart from the answer as the output streams, in the model's format.

:class:`ReasoningParser` is fed the output's text piece by piece (a piece may end
anywhere, inside a marker too) and gives back, for each piece, the thoughts and the
answer text that are settled now; a tail that may still become a marker is held.
It runs once per request, on the last stage (``meshd.engines.runner.thinking``),
which sends thoughts and answer apart: every API dialect shows them from there, and
the tool-call parser reads the answer only."""

from __future__ import annotations

import re
from typing import Literal, Protocol

from ..tools.base import partial_suffix
from .formats import TAGS, Tags

__all__ = ["ReasoningParser"]

#: Thoughts, then answer text, settled by one piece of output.
Split = tuple[str, str]


def _partial(text: str, tags: tuple[str, ...], longest: int, firsts: str) -> int:
    """:func:`partial_suffix` with a fast answer for the usual token: one whose tail
    holds none of the tags' first characters (``firsts``) cannot begin one."""
    tail = text[-longest:]
    if not any(c in tail for c in firsts):
        return 0
    return partial_suffix(text, tags)


#: The tag formats by name (a name from the wire may be any string).
_TAGS: dict[str, Tags] = {name: tags for name, tags in TAGS.items()}


class _Reader(Protocol):
    @property
    def thinking(self) -> bool: ...

    @property
    def ended(self) -> bool: ...

    def feed(self, text: str, final: bool) -> Split: ...


class ReasoningParser:
    """Splits one output, as it streams, into thoughts and answer.

    ``open``: the prompt ended inside the thoughts (a template that opens them in its
    generation prompt), so the output starts with thoughts and only their close marker
    appears. Otherwise thoughts are read only at the start of the output (after
    blanks), where the model opens them itself; an output that starts otherwise is all
    answer. Thoughts with no close marker before the output ends are all thoughts.
    """

    def __init__(self, fmt: str, *, open: bool = False) -> None:
        """``fmt``: the model's format (:func:`~.formats.reasoning_format`; a name
        from the wire: ValueError for one this node does not know)."""
        tags = _TAGS.get(fmt)
        if fmt != "harmony" and tags is None:
            raise ValueError(f"unknown reasoning format {fmt!r}")
        self.fmt = fmt
        self._reader: _Reader = _TagReader(tags, open) if tags is not None else _HarmonyReader()

    @property
    def thinking(self) -> bool:
        """Inside the thoughts now."""
        return self._reader.thinking

    @property
    def ended(self) -> bool:
        """The thoughts are over (or there were none): what follows is the answer."""
        return self._reader.ended

    def feed(self, text: str) -> Split:
        """The thoughts and the answer text settled after ``text``."""
        return self._reader.feed(text, False)

    def finish(self) -> Split:
        """Everything still held, once the output has ended."""
        return self._reader.feed("", True)


class _TagReader:
    """Thoughts between two tags at the start of the output. The blanks around the
    thoughts (after the open tag, before and after the close tag) are no one's text."""

    def __init__(self, tags: Tags, open: bool) -> None:
        self._open, self._close = tags.open, tags.close
        self._state: Literal["start", "thoughts", "after", "answer"] = (
            "thoughts" if open else "start"
        )
        self._fresh = True  # no thought shown yet: leading blanks are dropped
        self._held = ""
        self._tail = len(self._close) - 1, self._close[0]

    @property
    def thinking(self) -> bool:
        return self._state == "thoughts"

    @property
    def ended(self) -> bool:
        return self._state in ("after", "answer")

    def feed(self, text: str, final: bool) -> Split:
        if self._state == "answer":  # the usual case once thoughts are over: no copy
            return "", text
        buf, self._held = self._held + text, ""
        thoughts = ""
        if self._state == "start":
            head = buf.lstrip()
            if head.startswith(self._open):
                buf, self._state = head[len(self._open) :], "thoughts"
            elif not final and self._open.startswith(head):  # blanks, or a tag begun
                self._held = buf
                return "", ""
            else:
                self._state = "answer"
                return "", buf
        if self._state == "thoughts":
            if self._fresh:
                buf = buf.lstrip()
                if not buf:
                    return "", ""
                self._fresh = False
            end = buf.find(self._close)
            if end < 0:
                keep = 0 if final else _partial(buf, (self._close,), *self._tail)
                body = buf[: len(buf) - keep]
                shown = body.rstrip()
                # Blanks may be the ones before the close tag: held until text follows.
                self._held = "" if final else body[len(shown) :] + buf[len(buf) - keep :]
                return shown, ""
            thoughts, buf, self._state = buf[:end].rstrip(), buf[end + len(self._close) :], "after"
        answer = buf.lstrip()
        if answer:
            self._state = "answer"
        return thoughts, answer


_START, _CHANNEL, _MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HEADERS = (_START, _CHANNEL, " to=functions.")
_STOPS = (*_ENDS, _START, _CHANNEL)
_HEADERS_TAIL = max(map(len, _HEADERS)) - 1, "<" + " "
_STOPS_TAIL = max(map(len, _STOPS)) - 1, "<"
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
# A header longer than this is no header: it is shown as text.
_MAX_HEADER = 512


class _HarmonyReader:
    """gpt-oss's harmony messages: an ``analysis`` message's body is thoughts; a
    ``final`` (or other) message's body is answer, without its markup; a message to
    ``functions.NAME`` is a call, passed on whole, markup and all, for the tool-call
    parser (``meshd.models.tools.harmony``). Text outside any message is answer."""

    def __init__(self) -> None:
        self._held = ""
        #: Inside a body: None (outside any), "analysis", "answer" or "call".
        self._body: Literal["analysis", "answer", "call"] | None = None
        self.ended = False

    @property
    def thinking(self) -> bool:
        return self._body == "analysis"

    def feed(self, text: str, final: bool) -> Split:
        self._held += text
        out: tuple[list[str], list[str]] = ([], [])
        while self._held:
            read = self._header if self._body is None else self._inside
            if not read(out, final):
                break
        return "".join(out[0]), "".join(out[1])

    def _header(self, out: tuple[list[str], list[str]], final: bool) -> bool:
        """Text up to a header, then the header read; False: wait for more."""
        held = self._held
        starts = [i for i in (held.find(h) for h in _HEADERS) if i >= 0]
        if not starts:
            keep = 0 if final else _partial(held, _HEADERS, *_HEADERS_TAIL)
            self._answer(out, held[: len(held) - keep])
            self._held = held[len(held) - keep :]
            return False
        start = min(starts)
        self._answer(out, held[:start])
        held = held[start:]
        end = held.find(_MESSAGE)
        if end < 0 or end > _MAX_HEADER:
            if end < 0 and not final and len(held) <= _MAX_HEADER:
                self._held = held
                return False
            self._answer(out, held[0])  # no header after all: shown, and read on
            self._held = held[1:]
            return True
        header, self._held = held[: end + len(_MESSAGE)], held[end + len(_MESSAGE) :]
        if "to=functions." in header:
            self._body = "call"
            self._answer(out, header)
        elif (m := _CHANNEL_NAME.search(header)) is not None and m.group(1) == "analysis":
            self._body = "analysis"
        else:
            self._body = "answer"
        if self._body != "analysis":
            self.ended = True
        return True

    def _inside(self, out: tuple[list[str], list[str]], final: bool) -> bool:
        """A body up to its end; False: wait for more."""
        held = self._held
        stops = [i for i in (held.find(s) for s in _STOPS) if i >= 0]
        side = out[0] if self._body == "analysis" else out[1]
        if not stops:
            keep = 0 if final else _partial(held, _STOPS, *_STOPS_TAIL)
            side.append(held[: len(held) - keep])
            self._held = held[len(held) - keep :]
            return False
        stop = min(stops)
        side.append(held[:stop])
        held = held[stop:]
        end = next((e for e in _ENDS if held.startswith(e)), "")
        if self._body == "call":
            side.append(end)  # the call's own end: the tool-call parser reads it
        if self._body == "analysis":
            self.ended = True
        self._body = None
        self._held = held[len(end) :]
        return True

    def _answer(self, out: tuple[list[str], list[str]], text: str) -> None:
        if text:
            out[1].append(text)
            self.ended = True

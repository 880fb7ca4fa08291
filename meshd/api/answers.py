"""What admitted runs give back, in no dialect: whole answers, or one event stream.

Every dialect's handler admits its runs (:func:`meshd.api.runs.admit_choices`), then
either takes :func:`whole` answers (read into :class:`Answer`, tool calls split out)
or renders :func:`events` as its own stream inside :func:`streamed`. Thoughts (the
last stage sends them apart from the answer), tool calls, finish reasons,
keep-alives, client disconnects, failures mid-stream and the request metrics are
handled here once; a dialect only chooses words and shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from meshd.node.errors import RequestFailed
from meshd.node.requests import KEEPALIVE
from meshd.transport import wire

from .errors import ApiError, request_failed
from .runs import Collected, Run, collect_all_unless_gone
from .toolcalls import Call, ChoiceCalls

__all__ = [
    "Answer",
    "Called",
    "Event",
    "Finished",
    "KeepAlive",
    "Text",
    "Thought",
    "answer",
    "client_closed",
    "events",
    "streamed",
    "whole",
]


@dataclass(frozen=True)
class Text:
    """Text of choice ``choice`` (and its tokens' log-probabilities, when asked for:
    tokens whose text is held back still report theirs, in the chunk that made them)."""

    choice: int
    text: str
    logprobs: list[wire.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Thought:
    """Thoughts of choice ``choice`` (a thinking model's, before its answer)."""

    choice: int
    text: str


@dataclass(frozen=True)
class Called:
    """Choice ``choice`` made its ``n``-th call."""

    choice: int
    call: Call
    n: int


@dataclass(frozen=True)
class Finished:
    """Choice ``choice`` ended: ``reason`` is ``stop``, ``length`` or ``tool_calls``."""

    choice: int
    reason: str
    usage: wire.Usage
    #: The stop string that ended it, if one did.
    stop_sequence: str | None = None


@dataclass(frozen=True)
class KeepAlive:
    """Nothing to say yet (the pipeline is being repaired): keep the connection busy."""


Event = Thought | Text | Called | Finished | KeepAlive


@dataclass
class Answer:
    """A whole answer of one choice, its calls read out."""

    #: The text outside the calls.
    text: str
    calls: list[Call]
    #: ``stop``, ``length``, or ``tool_calls`` when it stopped after calling.
    finish_reason: str
    usage: wire.Usage
    logprobs: list[wire.TokenLogprob]
    stop_sequence: str | None
    #: The model's thoughts ("": none).
    reasoning: str = ""


def _finish(reason: str, reader: ChoiceCalls | None) -> str:
    return "tool_calls" if reader is not None and reader.calls and reason == "stop" else reason


def answer(c: Collected, reader: ChoiceCalls | None) -> Answer:
    """``c`` with its tool calls read out (``reader`` None: the request offered none)."""
    if reader is None:
        return Answer(
            c.text, [], c.finish_reason, c.usage, c.logprobs, c.stop_sequence, c.reasoning
        )
    head, _ = reader.feed(c.text)
    tail, _ = reader.finish(c.finish_reason)
    reason = _finish(c.finish_reason, reader)
    return Answer(
        head + tail, reader.calls, reason, c.usage, c.logprobs, c.stop_sequence, c.reasoning
    )


def _count(runs: list[Run], outcome: str) -> None:
    for run in runs:
        run.count(outcome)


async def whole(request: Request, runs: list[Run]) -> list[Collected] | None:
    """Every run's whole answer, or None when the client left first (answer 499 then).

    Closes the runs and counts their outcome; a failure is raised as an ApiError.
    """
    try:
        got = await collect_all_unless_gone(runs, request)
    except RequestFailed as e:
        _count(runs, str(e.status))
        raise request_failed(e) from None
    finally:
        for run in runs:
            await run.close()
    _count(runs, "200" if got is not None else "client_closed")
    return got


def client_closed() -> Response:
    """What a client that left before its answer was ready gets (nobody reads it)."""
    return Response(status_code=499)


async def _merged(runs: list[Run]) -> AsyncIterator[tuple[int, wire.DataChunk]]:
    """Every run's chunks as they come, tagged with the choice's index (one run: read
    directly, with no queue in the way of each token)."""
    if len(runs) == 1:
        async with contextlib.aclosing(runs[0].pieces()) as it:
            async for c in it:
                yield 0, c
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    done = object()

    async def pump(i: int, run: Run) -> None:
        try:
            async with contextlib.aclosing(run.pieces()) as it:
                async for c in it:
                    await queue.put((i, c))
        except RequestFailed as e:
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, RequestFailed):
                raise item
            else:
                assert isinstance(item, wire.DataChunk)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def events(
    runs: list[Run], readers: list[ChoiceCalls | None] | None = None
) -> AsyncIterator[Event]:
    """The runs' output as events, choices interleaved as they come; ``readers[i]``
    splits choice ``i``'s calls out of its text (None: no tools offered).

    Raises RequestFailed when a run fails.
    """
    readers = readers or [None] * len(runs)
    async for i, c in _merged(runs):
        if c is KEEPALIVE:
            yield KeepAlive()
            continue
        if c.reasoning:
            yield Thought(i, c.reasoning)
        reader = readers[i]
        text = c.text
        new: list[Call] = []
        if reader is not None:
            text, new = reader.feed(c.text)
            if c.finish_reason:
                rest, more = reader.finish(c.finish_reason)
                text, new = text + rest, new + more
        if text or c.logprobs:
            yield Text(i, text, c.logprobs)
        for call in new:
            assert reader is not None
            yield Called(i, call, reader.calls.index(call))
        if c.finish_reason:
            usage = c.usage or wire.Usage(runs[i].n_prompt, 0)
            yield Finished(i, _finish(c.finish_reason, reader), usage, c.stop_sequence)


def streamed(
    runs: list[Run],
    body: AsyncGenerator[bytes, None],
    on_error: Callable[[ApiError], bytes],
    *,
    media_type: str,
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """A streaming response of ``body`` (a dialect's rendering of :func:`events`).

    A run that fails mid-stream ends the stream with ``on_error``'s bytes (the status
    has been sent); the runs are closed and their outcome counted however it ends.
    """

    async def guarded() -> AsyncIterator[bytes]:
        outcome = "200"
        try:
            async for b in body:
                yield b
        except RequestFailed as e:
            outcome = str(e.status)
            yield on_error(request_failed(e))
        finally:
            await body.aclose()
            for run in runs:
                await run.close()
            _count(runs, outcome)

    out = guarded()
    # Backstop: a stream the server never starts (client gone before the first byte)
    # never runs its finally; its slots come back when it is freed.
    for run in runs:
        weakref.finalize(out, run.ticket.release)
    return StreamingResponse(out, media_type=media_type, headers=headers)

"""A last stage's output, coalesced: one ``DataChunk`` per request per interval.

Every chunk a runner sends wakes the API node three times (ZeroMQ's I/O thread, the
event loop, the HTTP write) and the client once. On a machine whose cores the engine's
threads fill, each wake-up preempts one of them, and the others wait for it at the next
barrier of the step: at 5 ms a token the node's share of the cores is small, but the
steps it lands in stall (over 1024 tokens, every token alone against 50 ms: node CPU
0.37 against 0.11 ms a token, the runner's main thread preempted 1227 against 250
times; bench/README.md has the A/B figures). So when tokens come faster than
``interval`` apart, a request's tokens wait here and go as one chunk: the first token of
an answer, its end and any error go at once, and no token waits longer than
``interval``. A pipeline slower than ``interval`` a token (any split over a LAN) sends
every token as it comes, as before. vLLM's ``--stream-interval`` makes the same trade.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from meshd.transport import wire

#: Default longest wait of a token: short beside what a reader notices (a screen
#: refresh is 16 ms), long beside a small model's step on a CPU (5 ms): 3-4 tokens a chunk.
STREAM_INTERVAL_S = 0.02


@dataclass
class _Held:
    reply_to: wire.Addr
    chunk: wire.DataChunk
    #: When it goes whatever follows (time.monotonic()).
    due: float


def is_plain(c: wire.DataChunk) -> bool:
    """A chunk that only carries tokens (text, logprobs, compute): the kind that may wait."""
    return bool(c.tokens) and (
        c.finish_reason is None
        and c.error is None
        and c.usage is None
        and c.n_prompt is None
        and c.tool_format is None
        and not c.embedding
    )


def merge(a: wire.DataChunk, b: wire.DataChunk) -> wire.DataChunk:
    """``a`` then ``b`` as one chunk: text, thoughts, tokens and logprobs in order,
    each stage's compute added up, everything else from ``b`` (the later, which may
    end the answer)."""
    if len(a.compute) == len(b.compute):
        compute = [x + y for x, y in zip(a.compute, b.compute, strict=True)]
    else:
        compute = b.compute or a.compute
    return msgspec.structs.replace(
        b, text=a.text + b.text, tokens=a.tokens + b.tokens, compute=compute,
        logprobs=a.logprobs + b.logprobs, reasoning=a.reasoning + b.reasoning,
    )  # fmt: skip


class Outbox:
    """Sends a runner's DataChunks: a request's tokens are held while they come faster
    than ``interval`` apart (0: never held), and what is ready for one API node when
    the runner's loop calls :meth:`flush` goes as one message."""

    def __init__(
        self,
        send: Callable[[wire.Addr, wire.Message], None],
        interval: float = STREAM_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self.interval = interval
        self._clock = clock
        #: Request -> when its last chunk went (requests with an answer under way).
        self._sent: dict[str, float] = {}
        self._held: dict[str, _Held] = {}
        #: Chunks that go at the next flush, by API node (its ROUTER's port and id).
        self._ready: dict[tuple[str, int], tuple[wire.Addr, list[wire.DataChunk]]] = {}

    def put(self, reply_to: wire.Addr, c: wire.DataChunk) -> None:
        """Queue ``c`` for the next :meth:`flush`, or hold it to go with the next of
        its request's chunks."""
        now = self._clock()
        held = self._held.pop(c.req, None)
        if held is not None:
            c = merge(held.chunk, c)
        if is_plain(c) and self.interval > 0:
            last = self._sent.get(c.req)
            due = last + self.interval if last is not None else now
            if now < due:
                self._held[c.req] = _Held(reply_to, c, due)
                return
        self._queue(reply_to, c, now)

    def _queue(self, reply_to: wire.Addr, c: wire.DataChunk, now: float) -> None:
        if c.finish_reason is not None or c.error is not None:
            self._sent.pop(c.req, None)
        elif c.tokens:
            self._sent[c.req] = now
        key = (reply_to.node, reply_to.port)
        entry = self._ready.get(key)
        if entry is None:
            self._ready[key] = (reply_to, [c])
        else:
            entry[1].append(c)

    def flush(self) -> None:
        """Send what is ready, and every held chunk whose time has come: one message
        per API node."""
        if self._held:
            now = self._clock()
            for req, h in list(self._held.items()):
                if h.due <= now:
                    del self._held[req]
                    self._queue(h.reply_to, h.chunk, now)
        if not self._ready:
            return
        ready, self._ready = self._ready, {}
        for reply_to, chunks in ready.values():
            # An embedding (a vector of up to tens of KiB) goes alone, in its place: a
            # batch stays far inside the API node's frame limit.
            batch: list[wire.DataChunk] = []
            for c in chunks:
                if c.embedding:
                    self._batch(reply_to, batch)
                    batch = []
                    self._send(reply_to, c)
                else:
                    batch.append(c)
            self._batch(reply_to, batch)

    def _batch(self, reply_to: wire.Addr, chunks: list[wire.DataChunk]) -> None:
        if len(chunks) == 1:
            self._send(reply_to, chunks[0])
        elif chunks:
            self._send(reply_to, wire.DataChunks(chunks=chunks))

    def next_due(self) -> float | None:
        """When :meth:`flush` next has something to send (time.monotonic()), or None."""
        if self._ready:
            return self._clock()
        return min((h.due for h in self._held.values()), default=None)

    def forget(self, req: str) -> None:
        """Drop what is held for ``req`` (it was cancelled: nobody reads it)."""
        self._held.pop(req, None)
        self._sent.pop(req, None)

"""A client that leaves: work it no longer waits for is stopped at once (an SDK's
timeout and retry would otherwise multiply the work)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

__all__ = ["unless_gone", "until_disconnected"]

T = TypeVar("T")


async def unless_gone(work: Awaitable[T], request: Request) -> T | None:
    """``work``'s result, or None as soon as the client closes the connection (then
    ``work`` is cancelled: nobody would read what it makes)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None
    finally:
        gone.cancel()


async def until_disconnected(request: Request) -> None:
    """Return when the client closes the connection (its body is already read, so the
    next ASGI message can only be ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

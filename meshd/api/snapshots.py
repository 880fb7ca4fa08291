"""A view as Server-Sent Events, paced the same for every stream (``GET
/v1/instances/stream``, ``GET /v1/cluster/stream``): one event at once, then a new one
whenever the view differs, woken by the node's ``Changes`` signal and looking again
every :data:`STREAM_REFRESH_S` for the figures heartbeats move; at most one every
:data:`STREAM_MIN_INTERVAL_S`; a keep-alive comment after :data:`STREAM_KEEPALIVE_S` of
quiet; the end when the node drains. A watcher costs one rendering every 2 s or so,
whatever the number of changes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import msgspec

from .services import Services
from .sse import SSE_KEEPALIVE, sse_data

__all__ = ["STREAM_KEEPALIVE_S", "STREAM_MIN_INTERVAL_S", "STREAM_REFRESH_S", "snapshot_events"]

#: A stream sends a new view at most this often (a burst of changes is one event).
STREAM_MIN_INTERVAL_S = 0.5
#: ... and looks again at least this often: speeds move with every heartbeat, which
#: does not wake ``Changes`` (only a change of topology or state does).
STREAM_REFRESH_S = 2.0
#: A quiet stream sends a comment this often, so proxies keep the connection.
STREAM_KEEPALIVE_S = 15.0


async def snapshot_events(
    services: Services,
    render: Callable[[], msgspec.Struct],
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[bytes]:
    """The events of a stream of ``render()``, until the client goes or the node
    drains."""
    last, sent_at = b"", clock()
    while True:
        # Armed before the look: a change made while this view is sent and paced still
        # ends the wait below (the signal wakes only the waiters it finds).
        wake = asyncio.ensure_future(services.changed(STREAM_REFRESH_S))
        try:
            event = sse_data(render())
            now = clock()
            if event != last:
                last, sent_at = event, now
                yield event
            elif now - sent_at >= STREAM_KEEPALIVE_S:
                sent_at = now
                yield SSE_KEEPALIVE
            if services.draining:
                return  # the node is stopping: its watchers go on with another node
            await asyncio.sleep(STREAM_MIN_INTERVAL_S)
            await wake
        finally:
            wake.cancel()

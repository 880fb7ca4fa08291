"""One signal for "the cluster changed": whoever waits on it wakes and looks again.

The shared map merging a change of topology (a card, an instance, a runner's state), a
liveness transition, a request of this node ending: each calls :meth:`Changes.notify`.
A waiter never trusts the signal for *what* changed; it re-reads the state, so a
notification that wakes it for nothing costs one look and no wrong answer. Waits keep
their own timeouts: the signal only makes them end sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

__all__ = ["Changes"]


class Changes:
    """Wakes waiters and listeners on every change (event-loop confined)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []

    def notify(self) -> None:
        """Wake every waiter and call every listener."""
        event, self._event = self._event, asyncio.Event()
        event.set()
        for listener in self._listeners:
            listener()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (synchronously, on the loop) at every change."""
        self._listeners.append(listener)

    async def wait(self, timeout: float) -> bool:
        """Until the next change (True) or ``timeout`` seconds (False)."""
        if timeout <= 0:
            return False
        event = self._event
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()
                return True
        return False

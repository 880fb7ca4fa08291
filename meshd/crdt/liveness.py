"""Liveness from heartbeats, judged on the reader's own monotonic clock.

A node is ``alive`` while its heartbeats keep arriving, ``suspect`` after
``suspect_after`` seconds of silence, ``dead`` after ``dead_after``. Coming back from
``dead`` takes ``revive_beats`` fresh heartbeats in a row (hysteresis), so one late
packet does not flap placements. A node that says it stopped is ``left`` at once.
Pure: every method takes ``now`` (seconds, monotonic) from the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

State = Literal["alive", "suspect", "dead", "left"]

#: Defaults, documented in docs/operations.md.
SUSPECT_AFTER = 1.2
DEAD_AFTER = 2.0
REVIVE_BEATS = 2


@dataclass
class _Track:
    seq: int = -1
    last_seen: float = 0.0
    state: State = "alive"
    fresh_beats: int = 0


@dataclass
class Liveness:
    """Per-node liveness with hysteresis."""

    suspect_after: float = SUSPECT_AFTER
    dead_after: float = DEAD_AFTER
    revive_beats: int = REVIVE_BEATS
    _nodes: dict[str, _Track] = field(default_factory=dict)

    def beat(self, node: str, seq: int, now: float, stopped: bool = False) -> None:
        """Record a heartbeat with sequence ``seq`` received at ``now``.

        ``seq`` must grow across restarts too (the node uses the heartbeat's HLC). Only a
        sequence newer than the last one counts: a replayed or reordered old heartbeat
        does not make a dead node look alive.
        """
        t = self._nodes.get(node)
        if t is None:
            # First word from this node: it is alive as of now (not "silent since 0").
            t = self._nodes[node] = _Track(last_seen=now)
        elif seq <= t.seq:
            # A replayed "stopped" is as stale as any other old beat.
            return
        t.seq = max(seq, t.seq)
        if stopped:
            t.state = "left"
            t.last_seen = now
            t.fresh_beats = 0
            return
        self._advance(t, now)
        if t.state in ("dead", "left"):
            # Beats closer together than the dead threshold count toward revival.
            gap_ok = now - t.last_seen <= self.dead_after
            t.fresh_beats = t.fresh_beats + 1 if gap_ok else 1
            if t.fresh_beats >= self.revive_beats:
                t.state = "alive"
                t.fresh_beats = 0
        else:
            t.state = "alive"
        t.last_seen = now

    def _advance(self, t: _Track, now: float) -> None:
        if t.state == "left":
            return
        age = now - t.last_seen
        if age > self.dead_after:
            t.state = "dead"
        elif age > self.suspect_after and t.state == "alive":
            t.state = "suspect"

    def state(self, node: str, now: float) -> State | None:
        """Current state of a node, or None if it never sent a heartbeat."""
        t = self._nodes.get(node)
        if t is None:
            return None
        self._advance(t, now)
        return t.state

    def age(self, node: str, now: float) -> float | None:
        """Seconds since the last heartbeat from a node."""
        t = self._nodes.get(node)
        return None if t is None else now - t.last_seen

    def is_live(self, node: str, now: float) -> bool:
        """Alive or suspect: still counted by placement (suspect does not move work)."""
        return self.state(node, now) in ("alive", "suspect")

    def nodes(self) -> list[str]:
        """Every node a heartbeat was ever seen from."""
        return list(self._nodes)

"""The instances whose stages this node runs that idled past their keep-alive: their
runners stop (memory given back) and come back when an API node wants them again
(see :mod:`meshd.domain.keepalive` for who says what).

The plan stays in the cluster state: only the runners stop. This node reports each stage
of a sleeping instance as ``unloaded`` in its heartbeat, so the API, ``meshctl top`` and
the repairs see an instance at rest, not a broken one. The supervisor reconciles with
the instances that are awake only (:meth:`Sleep.awake`); a change of the sleeping set,
by the clock or by a heartbeat, reconciles again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from meshd.crdt.views import Instance, RunnerStatus
from meshd.domain.keepalive import asleep, live_words, until

from .runner_procs import RunnerProc
from .state import ClusterState

__all__ = ["SLEEP_CHECK_S", "Sleep"]

log = logging.getLogger("meshd.supervisor")

#: How often the keep-alives are looked at again (an unload is this late at most).
SLEEP_CHECK_S = 1.0


class Sleep:
    """Which instances sleep on this node, decided from the live nodes' words, this
    node's runners' activity and the node's default keep-alive."""

    def __init__(self, node_id: str, state: ClusterState, keep_alive: float) -> None:
        self.node_id = node_id
        self.state = state
        self.keep_alive = keep_alive
        #: Instances asleep now, and when each instance was last seen busy here (or
        #: first seen: the fallback when no API node has said anything of it).
        self.sleeping: set[str] = set()
        self._busy_at: dict[str, float] = {}
        self._proposed: dict[str, int] = {}

    def _busy(self, runners: Iterable[RunnerProc]) -> set[str]:
        """Instances whose runners here hold a request, or drafted since last time (a
        draft model's runner serves other runners, not the API: drafting is its use)."""
        busy = set()
        for r in runners:
            iid = r.key.instance
            drafted = r.proposed != self._proposed.get(iid, r.proposed)
            self._proposed[iid] = r.proposed
            if r.active or r.waiting or drafted:
                busy.add(iid)
        return busy

    def update(self, instances: dict[str, Instance], runners: Iterable[RunnerProc]) -> bool:
        """Decide again which of this node's instances sleep; whether that changed."""
        view = self.state.view()
        now, busy, words = time.time(), self._busy(runners), live_words(view.healths, view.is_live)
        nid = self.node_id
        here = {i for i, inst in instances.items() if any(s.node == nid for s in inst.stages)}
        self._busy_at = {
            i: now if i in busy or i not in self._busy_at else self._busy_at[i] for i in here
        }
        sleeping = set()
        for iid in here:
            fallback = until(self._busy_at[iid], self.keep_alive)
            if asleep(words.get(iid, []), iid in busy, fallback, now):
                sleeping.add(iid)
        for iid in sleeping - self.sleeping:
            log.info("instance %s idle past its keep-alive: its runners here stop", iid)
        for iid in self.sleeping - sleeping:
            log.info("instance %s wanted again: its runners here start", iid)
        changed, self.sleeping = sleeping != self.sleeping, sleeping
        return changed

    def awake(self, instances: dict[str, Instance]) -> dict[str, Instance]:
        """``instances`` less those asleep here (what this node's runners follow)."""
        return {i: inst for i, inst in instances.items() if i not in self.sleeping}

    def statuses(self, instances: dict[str, Instance]) -> list[RunnerStatus]:
        """An ``unloaded`` status for each stage here of a sleeping instance."""
        return [
            RunnerStatus(instance=iid, generation=inst.generation, stage=i, state="unloaded")
            for iid in sorted(self.sleeping)
            if (inst := instances.get(iid)) is not None
            for i, st in enumerate(inst.stages)
            if st.node == self.node_id
        ]

    async def run(
        self,
        instances: Callable[[], dict[str, Instance]],
        runners: Callable[[], Iterable[RunnerProc]],
        reconcile: Callable[[], None],
        every: float = SLEEP_CHECK_S,
    ) -> None:
        """Decide every ``every`` seconds and on every cluster change; ``reconcile()``
        when the sleeping set changed."""
        while True:
            if self.update(instances(), runners()):
                reconcile()
            await self.state.changes.wait(every)

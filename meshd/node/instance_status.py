"""How an instance is doing, in plain data: each stage's state as the heartbeats report
it (:class:`StageState`), the instance's state in one word, how far its fetches are,
and its speed as the nodes that sent it requests measured it.

Pure functions of their arguments; :class:`~.cluster.ClusterView`'s queries hand them
their inputs (and re-export them: the API reads them from there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from meshd.crdt.views import Health, Instance, ModelSpeed
from meshd.transport import wire

__all__ = [
    "INSTANCE_STATES",
    "InstanceSpeed",
    "StageState",
    "fetch_progress",
    "instance_state",
    "speed_of",
]


@dataclass(frozen=True, slots=True)
class StageState:
    """What the cluster says about one stage of an instance."""

    node: str
    state: str
    reason: str
    addr: wire.Addr | None
    #: While ``fetching``: bytes of the slice verified, of the total, bytes per second.
    fetched: int = 0
    fetch_total: int = 0
    fetch_rate: float = 0.0


def fetch_progress(states: list[StageState]) -> tuple[str, float]:
    """How far the stages that fetch their slice are, in words, and the seconds the
    slowest still needs at its rate (("", 0.0) when none fetches)."""
    fetching = [s for s in states if s.state == "fetching"]
    if not fetching:
        return "", 0.0
    done = sum(s.fetched for s in fetching)
    total = sum(s.fetch_total for s in fetching)
    rate = sum(s.fetch_rate for s in fetching)
    eta = max(
        ((s.fetch_total - s.fetched) / s.fetch_rate for s in fetching if s.fetch_rate > 0),
        default=0.0,
    )
    if total <= 0:
        return "asking the nodes that hold it", 0.0
    return f"{done / 1e6:.1f} of {total / 1e6:.1f} MB at {rate / 1e6:.1f} MB/s", eta


#: Where an instance stands, in one word (see :func:`instance_state`).
INSTANCE_STATES = ("ready", "unrepairable", "repairing", "fetching", "loading", "unloaded")


def instance_state(states: list[StageState], unrepairable: str | None) -> str:
    """Where an instance with these stage states stands: ``ready`` (every stage ready:
    it serves), ``unrepairable`` (a stage lost and no plan fits the nodes left: it will
    not serve by itself), ``repairing`` (a stage lost: its node not live or its runner
    failed; the survivors re-place it), ``fetching`` (a stage fetches its slice) or
    ``unloaded`` (every stage's runners stopped after its keep-alive: the next request
    loads it again) or ``loading`` (the rest: runners starting, loading, or not
    reported yet)."""
    if all(s.state == "ready" and s.addr is not None for s in states):
        return "ready"
    if unrepairable:
        return "unrepairable"
    if any(s.state in ("unavailable", "failed") for s in states):
        return "repairing"
    if any(s.state == "fetching" for s in states):
        return "fetching"
    if all(s.state == "unloaded" for s in states):
        return "unloaded"
    return "loading"


@dataclass(frozen=True, slots=True)
class InstanceSpeed:
    """One instance's figures over the last minute, from the heartbeats of every node
    whose API sent it requests (``Health.serving``, by instance id)."""

    #: Tokens per second streamed, and requests in flight (sums over those nodes).
    tokens_s: float = 0.0
    in_flight: int = 0
    #: Requests holding KV on its stage 0 now, and queued there for a sequence (that
    #: node's last heartbeat).
    busy: int = 0
    queue: int = 0
    #: Time to first token, between tokens, and per hop: the medians each node
    #: measured, weighted by its tokens/s (None: nobody measured one).
    ttft_ms: float | None = None
    itl_ms: float | None = None
    hop_ms: float | None = None
    #: Milliseconds per token of each stage, weighted alike (None: not measured).
    stage_ms: tuple[float | None, ...] = ()


def _weighted(pairs: list[tuple[float, float]]) -> float | None:
    """The mean of the ``(value, weight)`` pairs with a value, weighted (a plain mean
    when every weight is 0; None when none has a value), to 3 decimals."""
    pairs = [(v, w) for v, w in pairs if v]
    if not pairs:
        return None
    total = sum(w for _, w in pairs)
    if total <= 0:
        return round(sum(v for v, _ in pairs) / len(pairs), 3)
    return round(sum(v * w for v, w in pairs) / total, 3)


def speed_of(healths: Mapping[str, Health], inst: Instance) -> InstanceSpeed:
    """What every node whose heartbeat in ``healths`` says it sent ``inst`` requests
    measured over the last minute, added up (see :class:`InstanceSpeed`)."""
    measured = [m for _, h in sorted(healths.items()) if (m := h.serving.get(inst.id)) is not None]
    h0 = healths.get(inst.stages[0].node) if inst.stages else None
    firsts = [r for r in (h0.runners if h0 else []) if r.instance == inst.id and r.stage == 0]

    def med(figure: Callable[[ModelSpeed], float]) -> float | None:
        return _weighted([(figure(m), m.tokens_s) for m in measured])

    stage_ms = tuple(
        _weighted([(m.stage_ms[i], m.tokens_s) for m in measured if len(m.stage_ms) > i])
        for i in range(len(inst.stages))
    )
    return InstanceSpeed(
        tokens_s=round(sum(m.tokens_s for m in measured), 2),
        in_flight=sum(m.in_flight for m in measured),
        busy=sum(r.active for r in firsts),
        queue=sum(r.waiting for r in firsts),
        ttft_ms=med(lambda m: m.ttft_ms),
        itl_ms=med(lambda m: m.itl_ms),
        hop_ms=med(lambda m: m.hop_ms),
        stage_ms=stage_ms,
    )

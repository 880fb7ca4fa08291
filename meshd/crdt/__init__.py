"""The cluster's shared state: HLC, LWW-map with tombstones, typed views. Pure, no I/O."""

from meshd.domain.facts import ModelFacts

from .hlc import HLC, ClockDriftError
from .liveness import Liveness
from .lww import N_BUCKETS, Entry, LWWMap, stable_horizon
from .views import (
    Health,
    Instance,
    InstanceSpec,
    NodeCard,
    RunnerStatus,
    Stage,
    cards,
    healths,
    instances,
)

__all__ = [
    "HLC",
    "N_BUCKETS",
    "ClockDriftError",
    "Entry",
    "Health",
    "Instance",
    "InstanceSpec",
    "LWWMap",
    "Liveness",
    "ModelFacts",
    "NodeCard",
    "RunnerStatus",
    "Stage",
    "cards",
    "healths",
    "instances",
    "stable_horizon",
]

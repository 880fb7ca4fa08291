"""Placement: a pure function from (spec, model facts, live nodes, previous plan) to stages.

No I/O, no clocks, no randomness: every node computes the same plan from the same
inputs, so no node coordinates the others. See :func:`place` for the rules.
"""

from .errors import PlacementError, Reason, fmt_bytes
from .place import (
    Offload,
    Placement,
    default_context,
    place,
    place_fetching,
    placement,
    repair_needed,
    stage_need,
    stage_offload,
)
from .policy import (
    DEFAULT_ENGINE_PREFERENCE,
    Policy,
    base_context,
    instance_context,
    instance_seats,
    next_generation,
    node_vram,
    plan_digest,
)
from .predict import predicted_tokens_s, predicted_transfer_s
from .resources import NodeResources, node_resources
from .support import SPLIT_PROVEN, engine_of, model_engines, split_refusal

__all__ = [
    "DEFAULT_ENGINE_PREFERENCE",
    "SPLIT_PROVEN",
    "NodeResources",
    "Offload",
    "Placement",
    "PlacementError",
    "Policy",
    "Reason",
    "base_context",
    "default_context",
    "engine_of",
    "fmt_bytes",
    "instance_context",
    "instance_seats",
    "model_engines",
    "next_generation",
    "node_resources",
    "node_vram",
    "place",
    "place_fetching",
    "placement",
    "plan_digest",
    "predicted_tokens_s",
    "predicted_transfer_s",
    "repair_needed",
    "split_refusal",
    "stage_need",
    "stage_offload",
]

"""What a plan's request is predicted to cost, from the nodes' measured figures: pure.

A request is priced as a prompt whose rows cross each hop once and an answer decoded
token by token around the ring:

* **decode**: per token, each stage reads the bytes of its layers a token runs (a MoE
  block's active experts), and the head's on the last, at its node's measured speed
  (``decode_bps``); each hop of the ring (the last stage's token goes back to the first)
  costs half the link's round trip plus :data:`HOP_MS`.
* **prefill transfer**: the prompt's hidden rows (``hidden_size`` x the hop's bytes per
  element, :data:`ROW_ELEMENT_BYTES`) cross each forward hop once, at that link's
  measured bandwidth. A link neither end has measured adds nothing (unknown is neutral:
  placement then weighs round trips alone, as before bandwidths were measured). The
  prompt's compute is not priced: the same layers run on some node whatever the split.

:func:`request_s` adds them up for :data:`ANSWER_TOKENS` answer tokens, and placement
compares plans by it (``place._place_fresh``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from meshd.crdt.views import Stage
from meshd.domain.facts import ModelFacts
from meshd.domain.nodes import NodeResources

from .policy import base_context

__all__ = [
    "ANSWER_TOKENS",
    "HOP_MS",
    "UNKNOWN_RTT_MS",
    "link_mbps",
    "link_rtt",
    "predicted_tokens_s",
    "predicted_transfer_s",
    "prompt_bytes",
    "request_s",
    "stage_reads",
    "token_ms",
    "transfer_s",
]

#: What a hop costs beyond half the link's round trip (serialising, the wake-ups of both ends:
#: measured ~0.5 ms on loopback), and the round trip assumed for a link neither end has measured.
HOP_MS = 0.5
UNKNOWN_RTT_MS = 1.0
#: Tokens of the answer a request is priced with (a chat turn's, an agent's edit).
ANSWER_TOKENS = 256
#: Bytes of one element of a hidden row on a hop, by ``InstanceSpec.activations``.
ROW_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


class Peer(Protocol):
    """A node as the prediction reads it: its id, speed and links to peers."""

    @property
    def id(self) -> str: ...
    @property
    def speed(self) -> float: ...  # decode_bps; 0: not measured
    @property
    def rtt(self) -> Mapping[str, float]: ...
    @property
    def bw(self) -> Mapping[str, float]: ...  # Mbit/s; absent: unknown


def link_rtt(a: Peer, b: Peer) -> float:
    """The round trip (ms) between ``a`` and ``b``: the less of what each measured."""
    got = [x for x in (a.rtt.get(b.id), b.rtt.get(a.id)) if x]
    return min(got) if got else UNKNOWN_RTT_MS


def link_mbps(a: Peer, b: Peer) -> float:
    """The bandwidth (Mbit/s) between ``a`` and ``b``: the less of what each measured
    (a link is as slow as its slower way); 0.0 when neither has."""
    got = [x for x in (a.bw.get(b.id), b.bw.get(a.id)) if x and x > 0]
    return min(got) if got else 0.0


def stage_reads(facts: ModelFacts, stages: Sequence[Stage]) -> list[int]:
    """Bytes each stage reads for one token: its layers' active bytes, and the head's
    on the last (a tied head reads the embedding)."""
    active = facts.active_layer_bytes()
    n = facts.n_layers
    head = facts.head_bytes or facts.embed_bytes
    return [sum(active[s.start : s.end]) + (head if s.end == n else 0) for s in stages]


def token_ms(reads: Sequence[int], ring: Sequence[Peer]) -> float:
    """Milliseconds of one decode step: ``reads[i]`` bytes at ``ring[i]``'s speed, plus
    each hop of the ring; ``inf`` when a node has not measured its speed."""
    ms = 0.0
    for read, c in zip(reads, ring, strict=True):
        if c.speed <= 0:
            return math.inf
        ms += 1000 * read / c.speed
    if len(ring) > 1:
        hops = zip(ring, [*ring[1:], ring[0]], strict=True)
        ms += sum(link_rtt(a, b) / 2 + HOP_MS for a, b in hops)
    return ms


def prompt_bytes(facts: ModelFacts, tokens: int, activations: str = "f16") -> int:
    """Bytes of the hidden rows of a ``tokens``-token prompt on one hop."""
    return tokens * facts.hidden_size * ROW_ELEMENT_BYTES.get(activations, 4)


def transfer_s(nbytes: int, ring: Sequence[Peer]) -> float:
    """Seconds ``nbytes`` take over each forward hop of ``ring`` (stage i to i + 1), at
    each link's measured bandwidth; a link with none adds nothing."""
    s = 0.0
    for a, b in itertools.pairwise(ring):
        mbps = link_mbps(a, b)
        if mbps > 0:
            s += nbytes * 8 / (mbps * 1e6)
    return s


def request_s(reads: Sequence[int], ring: Sequence[Peer], nbytes: int) -> float:
    """Seconds of one request through ``ring``: the prompt's ``nbytes`` of rows over its
    hops and :data:`ANSWER_TOKENS` decode steps; ``inf`` when a speed is unknown."""
    return transfer_s(nbytes, ring) + ANSWER_TOKENS * token_ms(reads, ring) / 1000


class _Node:
    """A :class:`Peer` from a node's resources."""

    def __init__(self, r: NodeResources) -> None:
        self.id = r.id
        bps = r.decode_bps
        self.speed = bps if math.isfinite(bps) and bps > 0 else 0.0
        self.rtt: Mapping[str, float] = r.rtt_ms
        self.bw: Mapping[str, float] = r.bw_mbps


def _ring(stages: Sequence[Stage], nodes: Iterable[NodeResources]) -> list[_Node] | None:
    by_id = {n.id: n for n in map(_Node, nodes)}
    if any(s.node not in by_id for s in stages):
        return None
    return [by_id[s.node] for s in stages]


def predicted_tokens_s(
    facts: ModelFacts, stages: Sequence[Stage], nodes: Iterable[NodeResources]
) -> float:
    """Decode tokens/s of one request that placement predicts for ``stages`` on
    ``nodes`` (``NodeResources``: their measured ``decode_bps`` and ``rtt_ms``); 0.0
    when a stage's node has not measured its speed (or is not among ``nodes``)."""
    ring = _ring(stages, nodes)
    if ring is None or not stages:
        return 0.0
    ms = token_ms(stage_reads(facts, stages), ring)
    return float(f"{1000 / ms:.4g}") if 0 < ms < math.inf else 0.0


def predicted_transfer_s(
    facts: ModelFacts,
    stages: Sequence[Stage],
    nodes: Iterable[NodeResources],
    activations: str = "f16",
    context: int = 0,
) -> float:
    """Seconds the rows of a prompt of ``context`` tokens (0: :func:`base_context`, what
    placement prices) take over the hops of ``stages`` at the links' measured bandwidth
    (``NodeResources.bw_mbps``); 0.0 for one stage or links not measured."""
    ring = _ring(stages, nodes)
    if ring is None:
        return 0.0
    nbytes = prompt_bytes(facts, context or base_context(facts), activations)
    return float(f"{transfer_s(nbytes, ring):.4g}")

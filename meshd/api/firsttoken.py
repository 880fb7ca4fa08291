"""Where a request's time to first token goes, from the API node's own timestamps.

Each phase is observed once per request, when its first token arrives, under
``meshd_first_token_phase_seconds{phase=...}`` (``bench/ttft.py`` reads them):

* ``api``: the HTTP request in (the access log's start) to its ``Generate`` handed to
  the data plane: the body read and parsed, the dialect's conversion, the instance found.
* ``admit``: the ``Generate`` sent to stage 0's acknowledgement back: both trips, the
  runner waking, and stage 0's admission (``stage0``, a part of it: the chat template
  rendered, the prompt tokenized, a sequence seated).
* ``prefill``: the engine time of the first step on every stage (the first chunk's
  ``compute``), but no more than the time from the acknowledgement to the first token
  (the step starts as the acknowledgement leaves, so their trips overlap it).
* ``deliver``: the rest until the first token reached the API node: the step waiting
  to start, the hops between stages and the token's chunk coming back.

``api`` + ``admit`` + ``prefill`` + ``deliver`` is the API node's time to first token,
from the request's arrival; what follows (the SSE event written and read) only the
client sees.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.node.metrics import Metrics
from meshd.transport import wire


@dataclass(frozen=True)
class Stamps:
    """perf_counter times of one request at the API node before its first token."""

    #: The HTTP request came in, its Generate went out, stage 0's acknowledgement came.
    t_in: float
    t_sent: float
    t_acked: float
    #: Stage 0's own admission time (``DataChunk.admit_s`` of the acknowledgement).
    admit_s: float = 0.0


def phases(s: Stamps, t_first: float, first: wire.DataChunk) -> dict[str, float]:
    """The phases (seconds) of a request whose first token came at ``t_first`` in
    ``first``, none negative."""
    after_ack = max(0.0, t_first - s.t_acked)
    prefill = min(sum(first.compute), after_ack)
    return {
        "api": max(0.0, s.t_sent - s.t_in),
        "admit": max(0.0, s.t_acked - s.t_sent),
        "stage0": s.admit_s,
        "prefill": prefill,
        "deliver": after_ack - prefill,
    }


def observe(metrics: Metrics, model: str, s: Stamps, t_first: float, first: wire.DataChunk) -> None:
    """Record the phases of one request's first token."""
    for phase, seconds in phases(s, t_first, first).items():
        metrics.first_token_phase.labels(model, phase).observe(seconds)

"""What the supervisor is configured with: one frozen settings object, built from the
node's :class:`~.config.NodeConfig` in one place (:meth:`SupervisorSettings.from_config`).

The supervisor's runtime collaborators (the node id, how a model name resolves to a
file, the cluster's keys, the status callback, the fetch of a slice) are not settings:
they are handed to :class:`~.supervisor.Supervisor` beside this object.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshd.placement.policy import KV_SEQUENCES, KV_TOKENS

from .config import (
    MAX_RESTARTS,
    MAX_RUNNERS,
    REQUEST_EXPIRY_S,
    RESTART_BACKOFF_S,
    RESTART_WINDOW_S,
    SLICE_CACHE_BYTES,
    STOP_GRACE_S,
    STREAM_INTERVAL_S,
    NodeConfig,
)

__all__ = ["SupervisorSettings"]


@dataclass(frozen=True, kw_only=True)
class SupervisorSettings:
    """Every number and place the supervisor reads (defaults: ``NodeConfig``'s)."""

    #: Where slices of GGUF files (cut here or fetched) are kept.
    cache_dir: Path
    #: The address runners bind their data-plane ROUTER on.
    bind_host: str
    #: Context (tokens) per request where the plan names none, and requests a runner
    #: holds KV for.
    n_ctx: int = KV_TOKENS
    n_seq_max: int = KV_SEQUENCES
    #: Most tokens one request may generate (None: the runner's own bound).
    max_tokens: int | None = None
    #: At most this many stages here, needing at most ``memory`` bytes (0: no cap):
    #: a plan is any member's word.
    max_runners: int = MAX_RUNNERS
    memory: int = 0
    #: Bytes of unused slices kept in ``cache_dir`` (least recently used go first).
    slice_cache: int = SLICE_CACHE_BYTES
    request_expiry: float = REQUEST_EXPIRY_S
    stream_interval: float = STREAM_INTERVAL_S
    #: Seconds a runner gets between SIGTERM and SIGKILL.
    stop_grace: float = STOP_GRACE_S
    #: Crash-loop breaker: more than ``max_restarts`` exits in ``restart_window``
    #: seconds and the runner is given up; restarts wait ``restart_backoff`` doubled.
    max_restarts: int = MAX_RESTARTS
    restart_window: float = RESTART_WINDOW_S
    restart_backoff: float = RESTART_BACKOFF_S

    @classmethod
    def from_config(cls, cfg: NodeConfig, *, memory: int) -> SupervisorSettings:
        """The settings ``meshd up`` was given; ``memory``: the bytes this machine
        offers (its memory, capped by ``--max-memory``), a fact found at start."""
        return cls(
            cache_dir=cfg.cache_dir,
            bind_host=cfg.mesh_host,
            n_ctx=cfg.n_ctx,
            n_seq_max=cfg.n_seq_max,
            max_tokens=cfg.max_tokens,
            max_runners=cfg.max_runners,
            memory=memory,
            slice_cache=cfg.slice_cache,
            request_expiry=cfg.request_expiry,
            stream_interval=cfg.stream_interval,
            stop_grace=cfg.stop_grace,
            max_restarts=cfg.max_restarts,
            restart_window=cfg.restart_window,
            restart_backoff=cfg.restart_backoff,
        )

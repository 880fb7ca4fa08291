"""Prometheus metrics of one node (its own registry: several nodes may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from meshd.transport import wire

from .speed import Speed

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    """Counters and histograms the API and the data plane update."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        #: The last minute of requests, for the heartbeat (``meshctl top``).
        self.speed = Speed()
        r = self.registry
        self.requests = Counter(
            "meshd_requests", "Inference requests by route and outcome",
            ["route", "model", "outcome"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "meshd_prompt_tokens", "Prompt tokens processed", ["model"], registry=r
        )
        self.prefix_hits = Counter(
            "meshd_prefix_cache_hits", "Requests that started from a cached prefix",
            ["model"], registry=r,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "meshd_prompt_tokens_cached",
            "Prompt tokens taken from the prefix cache (not computed again)",
            ["model"], registry=r,
        )  # fmt: skip
        self._draft_metrics(r)
        self.completion_tokens = Counter(
            "meshd_completion_tokens", "Tokens generated", ["model"], registry=r
        )
        self.ttft = Histogram(
            "meshd_time_to_first_token_seconds", "Request start to first token",
            ["model"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.first_token_phase = Histogram(
            "meshd_first_token_phase_seconds",
            "Time to first token by phase (meshd.api.firsttoken: api, admit, stage0, "
            "prefill, deliver)", ["model", "phase"], buckets=_FAST, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "meshd_inter_token_seconds", "Time between tokens of one stream",
            ["model"], buckets=_FAST, registry=r,
        )  # fmt: skip
        self.stage_compute = Histogram(
            "meshd_stage_compute_seconds", "Engine time of one step on one stage",
            ["model", "stage"], buckets=_FAST, registry=r,
        )  # fmt: skip
        self.hop_overhead = Histogram(
            "meshd_pipeline_overhead_seconds",
            "Per token: time between tokens minus the stages' compute (network hops, "
            "wake-ups, HTTP), divided by the number of hops",
            ["model"], buckets=_FAST, registry=r,
        )  # fmt: skip
        self.in_flight = Gauge("meshd_requests_in_flight", "Requests this node owns", registry=r)
        self._queue_metrics(r)
        self.runners = Gauge(
            "meshd_runners", "Runner subprocesses on this node by state", ["state"], registry=r
        )
        self._fault_metrics(r)
        self.dropped = Counter(
            "meshd_dropped_frames", "Frames dropped by socket and reason",
            ["socket", "reason"], registry=r,
        )  # fmt: skip

    def _fault_metrics(self, r: CollectorRegistry) -> None:
        """Runners this node ended for a fault of theirs."""
        self.stage_faults = Counter(
            "meshd_stage_faults",
            "Runners on this node given up because their output was corrupt (NaN, Inf, or "
            "past the bound: meshd.engines.guard), by instance",
            ["instance"], registry=r,
        )  # fmt: skip
        self.stage_stalls = Counter(
            "meshd_stage_stalls",
            "Runners on this node ended (and restarted) because they made no progress "
            "(meshd.node.watchdog), by instance",
            ["instance"], registry=r,
        )  # fmt: skip
        #: What each counted so far, by its name (a sync adds the supervisor's new ones).
        self.seen: dict[str, dict[str, int]] = {}

    def _draft_metrics(self, r: CollectorRegistry) -> None:
        """Speculative decoding's counters."""
        self.drafted_tokens = Counter(
            "meshd_draft_tokens",
            "Tokens drafted for speculative decoding, by who wrote them (lookup: the "
            "request's own text; model: a draft model)",
            ["model", "proposer"], registry=r,
        )  # fmt: skip
        self.accepted_tokens = Counter(
            "meshd_draft_tokens_accepted", "Drafted tokens the model agreed with",
            ["model", "proposer"], registry=r,
        )  # fmt: skip
        self.chained_steps = Counter(
            "meshd_draft_steps_chained",
            "Drafted steps that held whole while the step after them was already on its "
            "way (speculation overlapped across a split's stages)",
            ["model"], registry=r,
        )  # fmt: skip
        self.proposed = Gauge(
            "meshd_draft_model_tokens",
            "Tokens a draft model's runner on this node drafted for other models' requests "
            "(since it started)",
            ["instance"], registry=r,
        )  # fmt: skip

    def _queue_metrics(self, r: CollectorRegistry) -> None:
        """How requests wait their turn in their stage 0's queue, and how their
        prompts share its engine calls."""
        self.prefills = Gauge(
            "meshd_stage0_prefills",
            "Stage 0's engine calls that ran prompt steps (calls), those steps (steps) "
            "and the most in one call (widest), by instance", ["instance", "figure"],
            registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "meshd_queue_wait_seconds",
            "Time a request waited for a sequence in its stage 0's queue (its turn)",
            ["model"], buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.queued = Gauge(
            "meshd_requests_queued",
            "Requests this node owns that wait for a sequence in their stage 0's queue",
            registry=r,
        )  # fmt: skip
        self.stage_queue = Gauge(
            "meshd_stage_queue_depth",
            "Requests (of any node) queued for a sequence on this node's stage 0 runners, "
            "by instance",
            ["instance"], registry=r,
        )  # fmt: skip

    def count_drafts(self, model: str, usage: wire.Usage) -> None:
        """Add one request's drafted and accepted tokens, by proposer, and its
        chained steps."""
        model_drafted, model_accepted = usage.model_drafted_tokens, usage.model_accepted_tokens
        for proposer, drafted, accepted in (
            (wire.DRAFT_BY_MODEL, model_drafted, model_accepted),
            (wire.DRAFT_BY_LOOKUP, usage.drafted_tokens - model_drafted,
             usage.accepted_tokens - model_accepted),
        ):  # fmt: skip
            if drafted:
                self.drafted_tokens.labels(model, proposer).inc(drafted)
                self.accepted_tokens.labels(model, proposer).inc(accepted)
        if usage.chained_steps:
            self.chained_steps.labels(model).inc(usage.chained_steps)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)

"""What a runner holds per request, and per unit of compute: plain data, no behaviour."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np

from meshd.domain.sampling import Sampling
from meshd.engines.constraint import Constraint
from meshd.engines.detok import TextStream
from meshd.engines.drafting import DraftBudget, InFlight
from meshd.engines.sampling import Sampler
from meshd.transport import wire

from .thinking import ThoughtTrack


@dataclass
class Request:
    """A request's state on this stage."""

    req: str
    seq: int
    route: list[wire.Addr]
    reply_to: wire.Addr
    sampling: Sampling
    n_prompt: int = 0
    n_generated: int = 0
    #: An embeddings request: the last stage pools, nothing is sampled.
    embed: bool = False
    #: Plan generation the request was admitted under.
    generation: int = 0
    #: Stage 0's KV slot for it (what the prefix cache keeps it under everywhere).
    slot: int = -1
    #: Stage 0: the tokens whose KV its sequence holds (prompt, then each token fed
    #: back), which the prefix cache matches new prompts against.
    tokens: list[int] | None = None
    #: Prompt positions taken from the prefix cache, and the slot they came from.
    n_cached: int = 0
    source: int = -1
    #: The key of its last prompt step (see :func:`.prefills.prefill_key`); None once it
    #: can share no more (it started from a cached prefix, or a step ran unkeyed).
    lineage: bytes | None = b""
    #: Stage 0: how many tokens to draft (None: it does not speculate), and its
    #: steps that have not come back.
    budget: DraftBudget | None = None
    flight: InFlight = field(default_factory=InFlight)
    #: Stage 0 and last stage: restarts of its steps so far (``wire.Token.epoch``).
    epoch: int = 0
    #: Stage 0: who asked (``Job.client``), for the queue's turns between clients.
    client: str = ""
    #: The exact mode (``wire.Start.exact``): its rows go on as float32.
    exact: bool = False
    #: time.perf_counter() when its last token was fed (0: none yet).
    fed_at: float = 0.0
    #: It has drafted: a step may come back to an earlier position (the rejected
    #: rows' KV is dropped then, on every stage).
    spec: bool = False
    #: Last stage: draft tokens verified, and accepted.
    n_drafted: int = 0
    n_accepted: int = 0
    #: Of those, the draft model's.
    n_model_drafted: int = 0
    n_model_accepted: int = 0
    #: Chained steps held whole (``wire.Usage.chained_steps``).
    n_chained: int = 0
    #: time.monotonic() of the last message or compute for this request.
    last_active: float = field(default_factory=time.monotonic)
    # Last stage only:
    #: A replay's first position to sample after (prompt + tokens already sent).
    replay_end: int = 0
    sampler: Sampler | None = None
    text: TextStream | None = None
    #: The grammar the output must follow (structured outputs, forced tool calls).
    constraint: Constraint | None = None
    #: Its thoughts (a thinking model's), and the tokens put in its output.
    track: ThoughtTrack | None = None

    def usage(self) -> wire.Usage:
        """What the request cost so far, as its last chunk reports it."""
        return wire.Usage(
            self.n_prompt, self.n_generated, self.n_cached, self.n_drafted, self.n_accepted,
            self.n_model_drafted, self.n_model_accepted, self.n_chained,
            self.track.n_thoughts if self.track is not None else 0,
        )  # fmt: skip


@dataclass
class Work:
    """One unit of compute for one request: tokens (stage 0) or hidden rows."""

    req: str
    pos: int
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    start: wire.Start | None = None
    #: Compute seconds of the stages before this one, for this step.
    compute: list[float] = field(default_factory=list)
    #: Draft tokens riding with the step's first token (its rows after the first):
    #: the last stage verifies them (speculative decoding).
    draft: list[int] = field(default_factory=list)
    #: Who wrote the draft (``wire.DRAFT_BY_LOOKUP`` / ``DRAFT_BY_MODEL``).
    draft_by: str = ""
    #: The request's epoch at stage 0 when it was sent (``wire.Token.epoch``).
    epoch: int = 0
    #: Stage 0: a prompt with images, as token runs and image rows in order (instead
    #: of ``tokens``): one step, whose rows go on in one activation.
    parts: list[np.ndarray] | None = None

    @property
    def rows(self) -> int:
        """Rows of input the step runs (tokens at stage 0, hidden rows after)."""
        if self.parts is not None:
            return sum(len(p) for p in self.parts)
        if self.tokens is not None:
            return len(self.tokens)
        assert self.hidden is not None  # a Work carries one or the other
        return len(self.hidden)


@dataclass
class Counters:
    """What a runner refused or freed on its own, by reason."""

    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Requests freed after ``request_expiry_s`` without activity.
    expired: int = 0
    #: Requests freed because the plan generation moved on.
    superseded: int = 0
    #: Prefills taken from another request with the same input (Stage.share).
    shared_prefills: int = 0
    #: Requests that started from a kept prefix, and the positions they took from it.
    prefix_hits: int = 0
    prefix_tokens: int = 0
    #: Kept prefixes dropped for going unused too long (``Seats.age``).
    prefixes_aged: int = 0
    #: Steps dropped unrun: sent before a restart of their request (``wire.Token``).
    stale_steps: int = 0
    #: Engine calls that ran prompt steps, the prompt steps they ran, and the most in
    #: one call: new requests that arrive together prefill in one call.
    prefill_calls: int = 0
    prefill_steps: int = 0
    widest_prefill: int = 0
    #: Seconds spent stepping so far (``Load.busy_s``): beside another stage's and the
    #: wall time, how much the stages of a split overlap.
    busy_s: float = 0.0
    #: The most requests one step took (``Load.widest``).
    widest: int = 0

    def drop(self, reason: str) -> None:
        """Count one frame dropped for ``reason``."""
        self.dropped[reason] += 1

    def prefilled(self, steps: int) -> None:
        """Count one engine call that ran ``steps`` prompt steps."""
        self.prefill_calls += 1
        self.prefill_steps += steps
        self.widest_prefill = max(self.widest_prefill, steps)

    def prefills(self) -> dict[str, int]:
        """The prefill counts as ``protocol.Load`` carries them."""
        return {"prefill_calls": self.prefill_calls, "prefill_steps": self.prefill_steps,
                "widest_prefill": self.widest_prefill}  # fmt: skip


class Refused(Exception):
    """A request this stage ends with a typed error (``code``, ``message``) instead
    of serving it."""

    def __init__(self, code: str, message: str, n_prompt: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        #: A prompt over the context: its tokens (the API words the error with them).
        self.n_prompt = n_prompt

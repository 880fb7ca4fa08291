"""The runner <-> supervisor protocol: one JSON object a line over the runner's stdio.

The supervisor starts ``python -m meshd.engines.runner INSTANCE STAGE`` (the two words
only name the process for ``ps``) and writes a :class:`RunnerConfig` as the first line
of its stdin: the config carries the keys of the node's sockets, which must never be in
an argument list (every user of the machine can read those) or in the environment
(inherited by whatever the runner starts). :func:`runner_command` builds both.

The runner reports on stdout (:data:`RunnerEvent`, tagged by ``"event"``): ``listening``
with its port, then ``ready`` or ``failed`` with a reason; later ``load`` (requests
holding KV), ``generation`` (a plan generation adopted) and ``expired`` (a request
freed after idling) and ``threads`` (the CPU threads its engine computes with now). It
reads commands on stdin after the config (:data:`RunnerCommand`, tagged by ``"cmd"``):
``generation`` (adopt a new plan generation), ``members`` (the client keys its sockets
admit), ``threads`` (compute with that many CPU threads from the next step) and
``stop``. EOF on stdin means the node is gone: the runner exits.
"""

from __future__ import annotations

import sys

import msgspec

from meshd.domain.facts import MaybeSha256
from meshd.logs import LogFormat
from meshd.transport.security import CurveKeys
from meshd.transport.wire import Addr

from .outbox import STREAM_INTERVAL_S

__all__ = [
    "BEAT_S",
    "REQUEST_EXPIRY_S",
    "STAGE_FAULT",
    "STREAM_INTERVAL_S",
    "Beat",
    "Expired",
    "Failed",
    "GenerationAdopted",
    "Listening",
    "Load",
    "Ready",
    "RunnerCommand",
    "RunnerConfig",
    "RunnerEvent",
    "SetGeneration",
    "SetMembers",
    "SetThreads",
    "SocketKeys",
    "Stop",
    "ThreadsSet",
    "decode_command",
    "decode_config",
    "decode_event",
    "encode",
    "runner_command",
]

#: Default idle time after which a request's KV is freed. Above the API node's chunk
#: timeout (30 s): the API node gives up on a silent pipeline first.
REQUEST_EXPIRY_S = 60.0


class SocketKeys(msgspec.Struct, kw_only=True, frozen=True):
    """CurveZMQ keys (Z85) of a runner's sockets: its node's own pair (its ROUTER binds
    with it, its DEALERs connect with it), and the members: the client keys its ROUTER
    admits and the key each DEALER names for the node it dials."""

    public: str
    secret: str
    #: Member node id -> its CURVE key.
    members: dict[str, str] = {}

    def __repr__(self) -> str:  # never print secret keys into a log
        return "SocketKeys(<keys hidden>)"

    @classmethod
    def of(cls, keys: CurveKeys, members: dict[str, bytes]) -> SocketKeys:
        """A node's keys, for its runners."""
        return cls(
            public=keys.public.decode(),
            secret=keys.secret.decode(),
            members={n: k.decode() for n, k in members.items()},
        )

    def curve(self) -> CurveKeys:
        """The node's pair as the socket edge takes it."""
        return CurveKeys(self.public.encode(), self.secret.encode())


class RunnerConfig(msgspec.Struct, kw_only=True):
    """Everything a runner needs, the first line of its stdin."""

    instance: str
    generation: int
    stage: int
    n_stages: int
    model_path: str
    sha256: MaybeSha256
    start: int
    end: int
    n_layers: int
    engine: str = "llama_cpp"
    cache_dir: str
    #: ``model_path`` is this stage's slice itself, fetched from the nodes that hold the
    #: model (every chunk checked against the digests most holders offer, the whole
    #: against the model's facts, before it was renamed into place: see
    #: ``meshd.transport.transfer``): its blocks count from 0, and there is no whole
    #: file here to check ``sha256`` against.
    sliced: bool = False
    bind_host: str = "0.0.0.0"
    n_ctx: int = 4096
    n_seq_max: int = 8
    #: Most tokens stage 0 drafts per step for a request that speculates (0: never).
    draft_max: int = 4
    #: Whether a request that does not say speculates (``InstanceSpec.speculate``):
    #: None as the runner decides, see ``Runner``'s admission.
    speculate: bool | None = None
    #: KV cache type of a llama.cpp stage (``InstanceSpec.kv_cache``).
    kv_cache: str = "f16"
    #: Layers a llama.cpp stage offloads to its GPUs, its last ones (one more than
    #: its layer count: the output head too); 0 on the CPU (see
    #: ``placement.stage_offload``).
    n_gpu_layers: int = 0
    exact: bool = False
    n_threads: int | None = None
    #: Wire type of the activations this stage sends on (see transport.tensors;
    #: ``InstanceSpec.activations``), but float32 for a request in the exact mode.
    send_dtype: str = "f32"
    #: A request with no message and no compute for this long is freed (see
    #: ``Runner.expire``); 0 or less never expires one.
    request_expiry_s: float = REQUEST_EXPIRY_S
    #: Most tokens a request may generate here, whatever its ``max_tokens`` says
    #: (None: up to the context's end).
    max_tokens: int | None = None
    #: Longest a generated token waits to go with the next ones in one DataChunk
    #: (see meshd.engines.outbox); 0 sends every token alone.
    stream_interval_s: float = STREAM_INTERVAL_S
    #: Rows the stage computes before it drops a prefix kept unused that long: the
    #: pipeline's (``meshd.engines.attention.pipeline_kept_rows``), 0 never; None:
    #: what this stage's engine says such KV costs it (``Stage.kept_rows``).
    kept_prefix_rows: int | None = None
    #: None: an open cluster (no CURVE).
    keys: SocketKeys | None = None
    #: How the runner logs: its node's ``--log-level`` and ``--log-format``, so that a
    #: node's log (runners' lines included) reads with one parser.
    log_level: str = "info"
    log_format: LogFormat = "text"


# -- events: runner -> supervisor (stdout) ---------------------------------------------


class Listening(msgspec.Struct, tag="listening", tag_field="event"):
    """The runner's ROUTER is bound on ``port`` (before the model loads)."""

    port: int


class Ready(msgspec.Struct, tag="ready", tag_field="event"):
    """The stage is loaded and serves; a decode step took ``layer_ms`` milliseconds
    per layer when it was timed right after loading (0: not timed)."""

    layer_ms: float = 0.0


#: How a runner's failure reason starts when its output was corrupt (see
#: ``meshd.engines.guard``): its node gives it up at once, and the stage moves.
STAGE_FAULT = "faulty output"


class Failed(msgspec.Struct, tag="failed", tag_field="event"):
    """The stage could not load (the runner exits after this), or its output was
    corrupt (``reason`` starts with :data:`STAGE_FAULT`; its node stops it)."""

    reason: str


class Load(msgspec.Struct, tag="load", tag_field="event"):
    """Requests holding KV on this stage now (and waiting for a sequence), its decode
    steps' milliseconds per layer as they run (see ``calibrate.LayerClock``; 0: none
    timed), and the tokens it has drafted for other models' requests so far (a draft
    model's runner)."""

    active: int
    layer_ms: float = 0.0
    proposed: int = 0
    #: Stage 0: requests queued for a sequence.
    waiting: int = 0
    #: Engine calls that ran prompt steps so far, those steps, and the most in one
    #: call (``runner.state.Counters``): whether new requests prefill together.
    prefill_calls: int = 0
    prefill_steps: int = 0
    widest_prefill: int = 0
    #: Seconds this stage has spent in its steps since it started, and the most
    #: requests one step took (stage 0 of a split: one micro-batch, see the runner).
    busy_s: float = 0.0
    widest: int = 0


class GenerationAdopted(msgspec.Struct, tag="generation", tag_field="event"):
    """The runner serves plan generation ``value`` from now on."""

    value: int


class Expired(msgspec.Struct, tag="expired", tag_field="event"):
    """Request ``req`` was freed after idling; ``total`` freed so far."""

    req: str
    total: int


class Beat(msgspec.Struct, tag="beat", tag_field="event"):
    """The runner lives (sent every :data:`BEAT_S` by a thread of its own, so it comes
    during a long step too): the engine step under way has run ``step_s`` seconds of
    the ``expect_s`` its measured speed predicts (0: between steps). A runner whose
    beats stop, or whose step runs far past its prediction, has stalled (see
    ``meshd.node.watchdog``)."""

    step_s: float = 0.0
    expect_s: float = 0.0


#: How often a runner beats.
BEAT_S = 0.25


class ThreadsSet(msgspec.Struct, tag="threads", tag_field="event"):
    """The stage computes with ``n`` CPU threads from its next step (0: its engine has
    no such setting, as MLX)."""

    n: int


RunnerEvent = Listening | Ready | Failed | Load | GenerationAdopted | Expired | Beat | ThreadsSet


# -- commands: supervisor -> runner (stdin) --------------------------------------------


class SetGeneration(msgspec.Struct, tag="generation", tag_field="cmd"):
    """Adopt plan generation ``value`` (the plan moved, this stage's range did not)."""

    value: int


class SetMembers(msgspec.Struct, tag="members", tag_field="cmd"):
    """The cluster's members from now on (node id -> CURVE key, Z85): the only senders
    taken, and the only nodes dialled. A member gone is no longer heard."""

    members: dict[str, str]


class SetDraft(msgspec.Struct, tag="draft", tag_field="cmd"):
    """Stage 0: ask the draft model ``instance`` (its runner at ``addr``) for drafts
    when a request speculates and its own text proposes nothing; None: no draft model."""

    instance: str | None = None
    addr: Addr | None = None


class SetThreads(msgspec.Struct, tag="threads", tag_field="cmd"):
    """Compute with ``n`` CPU threads from the next step: the cores other processes
    leave free changed (see ``meshd.engines.freecores``)."""

    n: int


class Stop(msgspec.Struct, tag="stop", tag_field="cmd"):
    """Exit now."""


RunnerCommand = SetGeneration | SetMembers | SetDraft | SetThreads | Stop

_events = msgspec.json.Decoder(RunnerEvent)
_commands = msgspec.json.Decoder(RunnerCommand)
_encoder = msgspec.json.Encoder()


def encode(msg: RunnerEvent | RunnerCommand | RunnerConfig) -> bytes:
    """One line (no newline) of the protocol."""
    return _encoder.encode(msg)


def runner_command(cfg: RunnerConfig) -> tuple[list[str], bytes]:
    """The argument list that starts a runner for ``cfg`` and the first bytes to write
    to its stdin (the config, one line)."""
    argv = [sys.executable, "-m", "meshd.engines.runner", cfg.instance, str(cfg.stage)]
    return argv, encode(cfg) + b"\n"


def decode_config(line: bytes) -> RunnerConfig:
    """The config line a runner reads first (raises msgspec errors on a bad one)."""
    return msgspec.json.decode(line, type=RunnerConfig)


def decode_event(line: bytes | str) -> RunnerEvent | None:
    """The event on one stdout line, or None for a line that is none (a stray print)."""
    try:
        return _events.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_command(line: bytes | str) -> RunnerCommand | None:
    """The command on one stdin line, or None for a line that is none."""
    try:
        return _commands.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None

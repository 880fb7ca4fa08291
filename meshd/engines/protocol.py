"""The runner <-> supervisor protocol: one JSON object a line over the runner's stdio.

The supervisor starts ``python -m meshd.engines.runner CONFIG_JSON`` (a
:class:`RunnerConfig`). The runner reports on stdout (:data:`RunnerEvent`, tagged by
``"event"``): ``listening`` with its port, then ``ready`` or ``failed`` with a reason;
later ``load`` (requests holding KV), ``generation`` (a plan generation adopted) and
``expired`` (a request freed after idling). It reads commands on stdin
(:data:`RunnerCommand`, tagged by ``"cmd"``): ``generation`` (adopt a new plan
generation) and ``stop``. EOF on stdin means the node is gone: the runner exits.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "REQUEST_EXPIRY_S",
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
    "Stop",
    "decode_command",
    "decode_event",
    "encode",
]

#: Default idle time after which a request's KV is freed. Above the API node's chunk
#: timeout (30 s): the API node gives up on a silent pipeline first.
REQUEST_EXPIRY_S = 60.0


class RunnerConfig(msgspec.Struct, kw_only=True):
    """Everything a runner needs, passed as JSON on its command line."""

    instance: str
    generation: int
    stage: int
    n_stages: int
    model_path: str
    sha256: str
    start: int
    end: int
    n_layers: int
    engine: str = "llama_cpp"
    cache_dir: str
    bind_host: str = "0.0.0.0"
    n_ctx: int = 4096
    n_seq_max: int = 8
    exact: bool = False
    n_threads: int | None = None
    #: Wire type of the activations this stage sends on (see transport.tensors);
    #: anything but f32 only between two MLX stages (InstanceSpec.activations).
    send_dtype: str = "f32"
    #: A request with no message and no compute for this long is freed (see
    #: ``Runner.expire``); 0 or less never expires one.
    request_expiry_s: float = REQUEST_EXPIRY_S


# -- events: runner -> supervisor (stdout) ---------------------------------------------


class Listening(msgspec.Struct, tag="listening", tag_field="event"):
    """The runner's ROUTER is bound on ``port`` (before the model loads)."""

    port: int


class Ready(msgspec.Struct, tag="ready", tag_field="event"):
    """The stage is loaded and serves."""


class Failed(msgspec.Struct, tag="failed", tag_field="event"):
    """The stage could not load (the runner exits after this)."""

    reason: str


class Load(msgspec.Struct, tag="load", tag_field="event"):
    """Requests holding KV on this stage now."""

    active: int


class GenerationAdopted(msgspec.Struct, tag="generation", tag_field="event"):
    """The runner serves plan generation ``value`` from now on."""

    value: int


class Expired(msgspec.Struct, tag="expired", tag_field="event"):
    """Request ``req`` was freed after idling; ``total`` freed so far."""

    req: str
    total: int


RunnerEvent = Listening | Ready | Failed | Load | GenerationAdopted | Expired


# -- commands: supervisor -> runner (stdin) --------------------------------------------


class SetGeneration(msgspec.Struct, tag="generation", tag_field="cmd"):
    """Adopt plan generation ``value`` (the plan moved, this stage's range did not)."""

    value: int


class Stop(msgspec.Struct, tag="stop", tag_field="cmd"):
    """Exit now."""


RunnerCommand = SetGeneration | Stop

_events = msgspec.json.Decoder(RunnerEvent)
_commands = msgspec.json.Decoder(RunnerCommand)
_encoder = msgspec.json.Encoder()


def encode(msg: RunnerEvent | RunnerCommand | RunnerConfig) -> bytes:
    """One line (no newline) of the protocol."""
    return _encoder.encode(msg)


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

"""The flags of ``meshd up``: the one table of a node's settings (the config file and the
environment take the same names, see :mod:`meshd.cli.settings`), in groups a reader
finds a setting by."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshd.cli.argtypes import (
    allowed_host,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from meshd.cli.keys import add_key_flags
from meshd.crdt.hlc import DEFAULT_MAX_DRIFT_MS
from meshd.domain.keepalive import DEFAULT_KEEP_ALIVE_S, parse_keep_alive
from meshd.logs import LOG_FORMATS
from meshd.models import DEFAULT_MODEL
from meshd.node.config import (
    CHUNK_TIMEOUT_S,
    DEFAULT_API_PORT,
    DEFAULT_CLUSTER,
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MESH_PORT,
    DRAIN_TIMEOUT_S,
    FORGET_AFTER_S,
    LOAD_WAIT_S,
    MAX_RESTARTS,
    MODELS_RESCAN_S,
    REPLAY_WAIT_S,
    REQUEST_EXPIRY_S,
    SLICE_CACHE_BYTES,
    STOP_GRACE_S,
    STREAM_INTERVAL_S,
    TOMBSTONE_GRACE_MS,
    parse_peer,
    parse_size,
)
from meshd.transport.security import SECRET_ENV

__all__ = ["add_node_flags"]


def add_node_flags(up: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags of ``meshd up`` to ``up``."""
    _where_flags(up)
    _model_flags(up)
    _access_flags(up)
    _cluster_timing_flags(up)
    _request_timing_flags(up)
    return up


def _where_flags(up: argparse.ArgumentParser) -> None:
    """Where this node is and how it is reached."""
    up.add_argument("--name", help="human name of this node (default: hostname)")
    up.add_argument(
        "--cluster", default=DEFAULT_CLUSTER, help="cluster name (default: %(default)s)"
    )
    up.add_argument(
        "--api-host",
        help="API listen address (default: 127.0.0.1; 0.0.0.0 when an API key is set)",
    )
    add_key_flags(up)
    up.add_argument(
        "--allow-host",
        action="append",
        default=[],
        type=allowed_host,
        metavar="NAME[:PORT]",
        help="another name the API is reached by (a proxy's, a DNS name): any port, or PORT",
    )
    up.add_argument(
        "--api-port",
        type=_port,
        default=DEFAULT_API_PORT,
        help="API port, 0 = any (default: %(default)s)",
    )
    up.add_argument(
        "--mesh-host", default="0.0.0.0", help="mesh listen address (default: %(default)s)"
    )
    up.add_argument(
        "--mesh-port",
        type=_port,
        default=DEFAULT_MESH_PORT,
        help="mesh port, 0 = any (default: %(default)s)",
    )
    up.add_argument(
        "--peer",
        action="append",
        default=[],
        type=_peer,
        metavar="HOST:MESH_PORT",
        help="static seed peer (repeatable)",
    )
    up.add_argument(
        "--data-dir",
        type=_path,
        help="where the node id lives (default: $MESHD_DATA_DIR or the user data dir)",
    )
    up.add_argument("--no-discovery", action="store_true", help="do not use Bonjour/mDNS")
    up.add_argument(
        "--advertise",
        action="append",
        default=[],
        metavar="ADDR",
        help="address peers should use (repeatable)",
    )


def _model_flags(up: argparse.ArgumentParser) -> None:
    """What it serves, and from what memory and disk."""
    up.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model the cluster should serve (default: %(default)s; '' for none)",
    )
    up.add_argument("--no-model", action="store_true", help="do not place any model")
    up.add_argument(
        "--models",
        action="append",
        default=[],
        type=_path,
        metavar="DIR",
        help="a folder of models this node may load and serve (repeatable); besides it "
        "loads only packaged aliases, the HF cache and paths given here or to its own API",
    )
    up.add_argument(
        "--max-memory",
        type=_size,
        default=0,
        metavar="SIZE",
        help="most memory this node offers the cluster, e.g. 8G (default: all it has)",
    )
    up.add_argument(
        "--context",
        type=nonnegative_int,
        default=0,
        metavar="TOKENS",
        help="context each request gets in the models this node places without one "
        "(the default model, a request's model, POST /v1/instances with no context); "
        "0, the default: the model's trained context as far as memory allows",
    )
    up.add_argument(
        "--slice-cache",
        "--cache-size",
        type=_size,
        default=SLICE_CACHE_BYTES,
        metavar="SIZE",
        help="disk kept for cached model slices no stage uses, e.g. 40G (default: 16G); "
        "least recently used go first",
    )


def _access_flags(up: argparse.ArgumentParser) -> None:
    """How it gets in, and what one caller may ask."""
    up.add_argument(
        "--secret-file",
        type=_path,
        metavar="PATH",
        help=f"the cluster's secret: a node holding it is a member at once, no approval "
        f"(for automation; default: ${SECRET_ENV}; make one with `meshctl secret new`)",
    )
    up.add_argument("--join", metavar="CODE", help="join with a code from `meshctl invite`")
    up.add_argument(
        "--open",
        action="store_true",
        help="an OPEN cluster for labs: no keys, any machine on the LAN joins and reads "
        "the traffic (the default asks a member to approve each new node)",
    )
    up.add_argument(
        "--max-requests",
        type=positive_int,
        default=DEFAULT_MAX_REQUESTS,
        metavar="N",
        help="completion requests in flight through this node before 429 (default: %(default)s)",
    )
    up.add_argument(
        "--max-tokens",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="most tokens one request may generate (default: %(default)s)",
    )


def _cluster_timing_flags(up: argparse.ArgumentParser) -> None:
    """How long the cluster waits on its members."""
    up.add_argument(
        "--forget-after",
        type=positive_float,
        default=FORGET_AFTER_S,
        metavar="SECONDS",
        help="forget a node silent this long: its card goes, tombstone collection "
        "resumes (default: %(default)s)",
    )
    up.add_argument(
        "--max-clock-drift",
        type=positive_int,
        default=DEFAULT_MAX_DRIFT_MS,
        metavar="MS",
        help="refuse entries stamped further ahead of this node's clock (default: %(default)s)",
    )
    up.add_argument(
        "--tombstone-grace",
        type=positive_int,
        default=TOMBSTONE_GRACE_MS,
        metavar="MS",
        help="collect deletes this far behind the cluster's stable horizon (default: %(default)s)",
    )
    up.add_argument(
        "--replay-wait",
        type=positive_float,
        default=REPLAY_WAIT_S,
        metavar="SECONDS",
        help="how long a request broken by a dead stage waits for the repaired plan "
        "before it ends with stage_lost (default: %(default)s)",
    )
    up.add_argument(
        "--models-rescan",
        type=positive_float,
        default=MODELS_RESCAN_S,
        metavar="SECONDS",
        help="how often the node looks again for the models it holds under its roots "
        "(a model copied or pulled there shows up in every node's list) "
        "(default: %(default)s)",
    )


def _request_timing_flags(up: argparse.ArgumentParser) -> None:
    """How long requests and runners are waited for, and the logs."""
    up.add_argument(
        "--load-wait",
        type=positive_float,
        default=LOAD_WAIT_S,
        metavar="SECONDS",
        help="how long a request waits for its model to load before a 503 with "
        "Retry-After (default: %(default)s)",
    )
    up.add_argument(
        "--keep-alive",
        type=_keep_alive,
        default=DEFAULT_KEEP_ALIVE_S,
        metavar="DURATION",
        help="how long an instance stays loaded after its last request, unless the request "
        "says (Ollama's keep_alive): seconds or a duration such as 10m; negative: forever "
        "(default: %(default)s s)",
    )
    up.add_argument(
        "--chunk-timeout",
        type=positive_float,
        default=CHUNK_TIMEOUT_S,
        metavar="SECONDS",
        help="silence between two chunks of a request before it ends with timeout "
        "(default: %(default)s)",
    )
    up.add_argument(
        "--request-expiry",
        type=positive_float,
        default=REQUEST_EXPIRY_S,
        metavar="SECONDS",
        help="a runner frees a request idle this long; keep it above --chunk-timeout "
        "(default: %(default)s)",
    )
    up.add_argument(
        "--stream-interval-ms",
        type=nonnegative_float,
        default=STREAM_INTERVAL_S * 1000,
        metavar="MS",
        help="a stream's tokens that come faster than this go to the client together, "
        "at most this late (fewer wake-ups of the node and client beside the engine); "
        "0 sends every token alone (default: %(default)s)",
    )
    up.add_argument(
        "--stop-grace",
        type=positive_float,
        default=STOP_GRACE_S,
        metavar="SECONDS",
        help="how long a runner gets to exit before SIGKILL (default: %(default)s)",
    )
    up.add_argument(
        "--max-restarts",
        type=positive_int,
        default=MAX_RESTARTS,
        metavar="N",
        help="runner exits in a minute before it is given up and its stage moves "
        "(default: %(default)s)",
    )
    up.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="how long a stopping node waits for its stages to move and its requests "
        "to finish (default: %(default)s)",
    )
    up.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    up.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object a line for log collectors; the node's "
        "runners log the same way (default: %(default)s)",
    )


def _keep_alive(text: str) -> float:
    try:
        seconds = parse_keep_alive(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    assert seconds is not None
    return seconds


def _port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return int(text)


def _size(text: str) -> int:
    """:func:`parse_size` as an argparse type: its message, not "invalid value"."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _peer(text: str) -> str:
    """A seed peer, checked by :func:`parse_peer` and kept as written (so that
    ``meshd config show`` prints it as given)."""
    try:
        parse_peer(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _path(text: str) -> Path:
    """A path; ``~`` expanded (a config file or ``--models=~/m`` has no shell to do it)."""
    return Path(text).expanduser()

"""``meshd``: the daemon's command line. ``meshd up`` starts a node."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
from pathlib import Path

import meshd
from meshd.api.app import create_app
from meshd.api.origins import allowed_hosts
from meshd.api.server import ApiServer, bind_api
from meshd.api.services import ApiSettings
from meshd.cli.argtypes import (
    allowed_host,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from meshd.cli.keys import add_key_flags, node_keys, refuse_argv
from meshd.cli.settings import (
    CONFIG_ENV,
    ConfigError,
    Resolved,
    Settings,
    default_config_path,
    given_dests,
)
from meshd.crdt.hlc import DEFAULT_MAX_DRIFT_MS
from meshd.logs import LOG_FORMATS, configure
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
    NodeConfig,
    parse_peer,
    parse_size,
)
from meshd.node.daemon import ApiAddress, Node
from meshd.node.dependencies import warn_untested
from meshd.node.owner import ensure_owner_token
from meshd.transport.addresses import local_addresses
from meshd.transport.security import SECRET_ENV, load_secret


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshd", description="meshd: pool machines into one LLM cluster"
    )
    p.add_argument("--version", action="version", version=f"meshd {meshd.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up",
        help="start a node (no configuration needed)",
        description="Start a node. Every flag may also be set in the config file "
        "(--api-port 7470: api_port = 7470) or the environment (MESHD_API_PORT=7470); "
        "a flag wins over the environment, which wins over the file. "
        "`meshd config show` prints the result.",
    )
    _node_flags(up)
    _config_flag(up)
    config = sub.add_parser("config", help="the settings of `meshd up`")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show",
        help="print the settings `meshd up` would run with, and where each comes from",
    )
    _node_flags(show)
    _config_flag(show)
    show.add_argument("--json", action="store_true", help="one JSON object, for machines")
    return p


def _config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML file of settings (default: ${CONFIG_ENV}, else "
        f"{default_config_path()} if it exists)",
    )


def _node_flags(up: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags of ``meshd up`` to ``up``: the one list of its settings (the config
    file and the environment take the same names, see :mod:`meshd.cli.settings`)."""
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
    up.add_argument(
        "--load-wait",
        type=positive_float,
        default=LOAD_WAIT_S,
        metavar="SECONDS",
        help="how long a request waits for its model to load before a 503 with "
        "Retry-After (default: %(default)s)",
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
    return up


def _config(args: argparse.Namespace) -> NodeConfig:
    if args.open and (args.secret_file or args.join):
        raise ValueError("--open runs a cluster without keys: it takes no --secret-file or --join")
    if args.join and args.secret_file:
        raise ValueError("--join and --secret-file are two ways in: give one")
    api_key, admin_key = node_keys(args)
    if args.open and api_key:
        logging.getLogger("meshd").warning(
            "the API key guards the API, but --open leaves the mesh open: any machine on "
            "the LAN can join the cluster and read prompts as they pass through it"
        )
    cfg = NodeConfig(
        cluster=args.cluster,
        api_host=args.api_host,
        api_port=args.api_port,
        mesh_host=args.mesh_host,
        mesh_port=args.mesh_port,
        peers=[parse_peer(p) for p in args.peer],
        discovery=not args.no_discovery,
        advertise=args.advertise,
        model="" if args.no_model else args.model,
        model_dirs=list(args.models),
        max_memory=args.max_memory,
        context=args.context,
        slice_cache=args.slice_cache,
        secret=load_secret(args.secret_file),
        join_code=args.join,
        open=args.open,
        api_key=api_key,
        admin_key=admin_key,
        allow_hosts=args.allow_host,
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        forget_after=args.forget_after,
        replay_wait=args.replay_wait,
        max_clock_drift_ms=args.max_clock_drift,
        tombstone_grace_ms=args.tombstone_grace,
        load_wait=args.load_wait,
        models_rescan=args.models_rescan,
        chunk_timeout=args.chunk_timeout,
        request_expiry=args.request_expiry,
        stream_interval=args.stream_interval_ms / 1000,
        stop_grace=args.stop_grace,
        max_restarts=args.max_restarts,
        drain_timeout=args.drain_timeout,
    )
    if args.name:
        cfg.name = args.name
    if args.data_dir:
        cfg.data_dir = args.data_dir
    return cfg


async def up(cfg: NodeConfig) -> int:
    """Run a node and its API until a stop signal; the process exit code.

    The composition root: the node finds its cluster (a new one waits for approval),
    the API socket is bound (its port goes in the node's card), the node is built and
    started, the API serves the node's services; at the stop, the node drains, leaves,
    the API stops, the node closes.
    """
    warn_untested()
    host = cfg.api_listen_host()
    bound: list[socket.socket] = []

    def bind() -> ApiAddress:
        bound.append(bind_api(host, cfg.api_port))
        return ApiAddress(host, bound[0].getsockname()[1])

    try:
        node = await Node.start(cfg, bind)
    except BaseException:
        for s in bound:
            s.close()
        raise
    sock = bound[0]
    card = node.presence.card
    settings = ApiSettings(
        api_key=cfg.api_key,
        admin_key=cfg.admin_key,
        owner_token=ensure_owner_token(cfg.data_dir),  # the data dir is the node's now
        max_requests=cfg.max_requests,
        max_tokens=cfg.max_tokens,
        hosts=allowed_hosts(
            card.addresses, local_addresses(), [host, socket.gethostname()], allow=cfg.allow_hosts
        ),
    )
    server = ApiServer(create_app(node.services, settings), sock, stop_grace=cfg.api_stop_grace)
    try:
        await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, node.request_stop)
        # One machine-readable line on stdout: scripts and tests wait for it.
        print(
            f"meshd ready node={node.node_id} name={cfg.name} "
            f"api=http://{card.api_host}:{card.api_port} "
            f"mesh={card.mesh_port} pub={card.pub_port}",
            flush=True,
        )
        await node.wait()
        if not node.hurried:
            await node.drain()
    finally:
        await node.leave()
        await server.stop()
        await node.close()
    return node.exit_code


def _settings(argv: list[str]) -> tuple[argparse.Namespace, Resolved]:
    """The command line, with each setting of ``up`` taken from the flags, else the
    environment, else the config file, else its default (raises ConfigError)."""
    args = _parser().parse_args(argv)
    table = Settings(_node_flags(argparse.ArgumentParser(add_help=False)))
    resolved = table.resolve(args, given_dests(_parser, argv), config=args.config)
    refuse_argv(resolved)
    return resolved.apply(args), resolved


def _show(resolved: Resolved, as_json: bool) -> int:
    print(json.dumps(resolved.as_json(), indent=2) if as_json else resolved.as_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshd`` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, resolved = _settings(argv)
    except ConfigError as e:
        # As argparse does for a bad flag: one line, exit 2, before anything starts.
        print(f"meshd: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        return _show(resolved, args.json)
    configure(args.log_level, args.log_format)
    try:
        return asyncio.run(up(_config(args)))
    except (ValueError, OSError, RuntimeError) as e:
        return _fail(e, 2 if isinstance(e, ValueError) else 1, args.log_format)
    except KeyboardInterrupt:  # Ctrl-C before the node was up (after, it drains and exits)
        return _fail(RuntimeError("interrupted before the node was up"), 130, args.log_format)


def _fail(e: Exception, code: int, fmt: str) -> int:
    """Report why the node could not run; the exit code. A JSON log stays JSON: a log
    collector must not need a second parser for the last line of a failed start."""
    if fmt == "json":
        logging.getLogger("meshd").error("%s", e)
    else:
        print(f"meshd: {e}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())

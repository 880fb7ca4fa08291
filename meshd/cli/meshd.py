"""``meshd``: the daemon's command line. ``meshd up`` starts a node."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

import meshd
from meshd.cli.keys import refuse_argv
from meshd.cli.pipes import reader_may_leave
from meshd.cli.settings import (
    CONFIG_ENV,
    ConfigError,
    Resolved,
    Settings,
    default_config_path,
    given_dests,
)
from meshd.cli.up_flags import add_node_flags
from meshd.logs import configure


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
    add_node_flags(up)
    _config_flag(up)
    config = sub.add_parser("config", help="the settings of `meshd up`")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show",
        help="print the settings `meshd up` would run with, and where each comes from",
    )
    add_node_flags(show)
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


def _settings(argv: list[str]) -> tuple[argparse.Namespace, Resolved]:
    """The command line, with each setting of ``up`` taken from the flags, else the
    environment, else the config file, else its default (raises ConfigError)."""
    args = _parser().parse_args(argv)
    table = Settings(add_node_flags(argparse.ArgumentParser(add_help=False)))
    resolved = table.resolve(args, given_dests(_parser, argv), config=args.config)
    refuse_argv(resolved)
    return resolved.apply(args), resolved


def _show(resolved: Resolved, as_json: bool) -> int:
    print(json.dumps(resolved.as_json(), indent=2) if as_json else resolved.as_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshd`` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return reader_may_leave(lambda: _main(argv))


def _main(argv: list[str]) -> int:
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
        from meshd.cli.up import node_config, up  # the node's whole stack: only for `up`

        return asyncio.run(up(node_config(args)))
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

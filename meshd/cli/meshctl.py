"""``meshctl``: talk to a running meshd cluster through any one of its nodes.

Every command but ``secret`` is an HTTP request to a node (``--node HOST:PORT``, else
the ``MESHCTL_NODE`` environment variable, else ``127.0.0.1:7470``; keys from files or
the environment, and the owner token from the data dir: ``keys.py``); nothing here
decides anything the node's API decides.

Adding a command: write ``_add_<name>(subparsers, common)`` that adds a subparser and
sets ``func`` to a ``(args, client) -> int`` function, and list it in ``COMMANDS`` (one
with many flags in a module of its own: ``place.py``).

Exit codes: 0 success, 1 the node answered with an error, 2 the node cannot be reached
or the command line is wrong, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence

from meshd import __version__

# What every command needs only: meshctl must start in 0.3 s, so each command imports
# the rest itself (rich's tables, the secret file's zmq) when it runs.
from .argtypes import positive_float
from .client import (
    DEFAULT_TIMEOUT,
    EXIT_INTERRUPTED,
    EXIT_NODE_ERROR,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    NODE_ENV,
    MeshctlError,
    NodeClient,
    NodeUnreachable,
    parse_node,
)
from .keys import add_meshctl_key_flags, meshctl_keys
from .pipes import reader_may_leave
from .place import add_place
from .secret import add_secret

Command = Callable[[argparse.Namespace, NodeClient], int]


# ---------------------------------------------------------------- commands


def cmd_top(args: argparse.Namespace, client: NodeClient) -> int:
    """Live view of nodes, memory, runners and instances."""
    from .top import run_top

    return run_top(client, interval=args.interval, once=args.once, as_json=args.json)


def cmd_nodes(args: argparse.Namespace, client: NodeClient) -> int:
    """The nodes this node knows, as a table or (``--json``) the raw list."""
    from .top import nodes_table, stdout_console

    cluster = client.cluster()
    if args.json:
        sys.stdout.write(json.dumps(cluster.get("nodes") or [], indent=2) + "\n")
        return EXIT_OK
    console = stdout_console()
    console.print(nodes_table(cluster, now_ms=int(time.time() * 1000), detail=True))
    return EXIT_OK


def cmd_models(args: argparse.Namespace, client: NodeClient) -> int:
    """The models the cluster holds: format, size, the nodes that hold each, and
    whether an instance serves it."""
    from .models import model_rows, models_table
    from .top import stdout_console

    rows = model_rows(client.cluster())
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return EXIT_OK
    if not rows:
        print("no node holds a model")
        return EXIT_OK
    stdout_console().print(models_table(rows))
    return EXIT_OK


def cmd_ls(args: argparse.Namespace, client: NodeClient) -> int:
    """List the placed instances and the state of each stage."""
    from .instances import print_instances

    data = client.instances().get("data") or []
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return EXIT_OK
    print_instances(data, client)
    return EXIT_OK


def cmd_rm(args: argparse.Namespace, client: NodeClient) -> int:
    """Remove an instance (its runners stop on every node)."""
    client.remove(args.instance)
    print(f"removed {args.instance}")
    return EXIT_OK


def cmd_chat(args: argparse.Namespace, client: NodeClient) -> int:
    """One-shot chat with PROMPT, or an interactive session without it (``chat.py``)."""
    from .chat import Conversation, ask, run_chat

    params: dict = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        params["temperature"] = args.temperature
    if args.exact:
        params["exact"] = True
    conv = Conversation(model=args.model, system=args.system or "")
    if args.prompt:
        return EXIT_OK if ask(client, conv, " ".join(args.prompt), params) else EXIT_INTERRUPTED
    return run_chat(client, conv, params)


# ---------------------------------------------------------------- parser


def _node(text: str) -> str:
    try:
        return parse_node(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_top(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("top", parents=[common], help=cmd_top.__doc__, description=cmd_top.__doc__)
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument(
        "--json", action="store_true", help="print what top shows as one JSON document and exit"
    )
    p.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default 1)",
    )
    p.set_defaults(func=cmd_top)


def _add_nodes(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "nodes", parents=[common], help=cmd_nodes.__doc__, description=cmd_nodes.__doc__
    )
    p.add_argument("--json", action="store_true", help="print the raw node list as JSON")
    p.set_defaults(func=cmd_nodes)


def _add_models(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "models", parents=[common], help=cmd_models.__doc__, description=cmd_models.__doc__
    )
    p.add_argument("--json", action="store_true", help="print the same rows as JSON")
    p.set_defaults(func=cmd_models)


def _add_ls(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("ls", parents=[common], help="List placed instances.")
    p.add_argument("--json", action="store_true", help="print the raw instance list")
    p.set_defaults(func=cmd_ls)


def _add_rm(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("rm", parents=[common], help="Remove an instance.")
    p.add_argument("instance", help="instance id (see `meshctl ls`)")
    p.set_defaults(func=cmd_rm)


def _add_chat(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from meshd.models.defaults import DEFAULT_MODEL

    p = sub.add_parser(
        "chat", parents=[common], help="Chat with a model (one-shot, or a session: /help)."
    )
    p.add_argument("prompt", nargs="*", help="one-shot prompt; none starts a session")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="model (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float)
    p.add_argument("--system", help="system prompt")
    p.add_argument(
        "--exact", action="store_true",
        help="the exact mode: no prefix reuse, no speculation (the same answer bit for "
        "bit whatever ran before; each turn computes its whole conversation)",
    )  # fmt: skip
    p.set_defaults(func=cmd_chat)


def cmd_doctor(args: argparse.Namespace, client: NodeClient) -> int:
    """Why a peer is missing or a model does not serve: the node's findings and fixes
    (exit 1 when one is an error)."""
    from .doctor import run_doctor

    return run_doctor(client, as_json=args.json)


def _add_doctor(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "doctor", parents=[common], help=cmd_doctor.__doc__, description=cmd_doctor.__doc__
    )
    p.add_argument("--json", action="store_true", help="print the node's report as JSON")
    p.set_defaults(func=cmd_doctor)


def cmd_members(args: argparse.Namespace, client: NodeClient) -> int:
    """The cluster's members, and the nodes waiting for approval at this node; `meshctl
    members rm NAME|ID` removes one for good (an owner's node only)."""
    from .approving import pending_lines

    if args.action == "rm":
        if not args.ref:
            print("meshctl members rm: name the member (its name or id)", file=sys.stderr)
            return EXIT_USAGE
        gone = client.remove_member(args.ref)
        print(
            f"removed {gone.get('name')} ({gone.get('id')}): every node refuses it from now "
            "on; to let it back in, approve it again"
        )
        return EXIT_OK
    got = client.members()
    if args.json:
        sys.stdout.write(json.dumps(got, indent=2) + "\n")
        return EXIT_OK
    for m in got.get("data") or []:
        by = "" if m.get("by") == m.get("id") else f"  (approved by {m.get('by')})"
        owner = "  owner" if m.get("owner") else ""
        print(f"{m.get('name')}  {m.get('id')}{owner}{by}")
    for line in pending_lines(got.get("pending") or []):
        print(line)
    return EXIT_OK


def cmd_approve(args: argparse.Namespace, client: NodeClient) -> int:
    """Let a waiting node in by the code its `meshd up` shows (`meshctl members` lists them)."""
    from .approving import approve_and_wait

    got, joined = approve_and_wait(client, args.code, args.id)
    who = ", ".join(f"{p.get('name')} ({p.get('id')})" for p in got)
    print(f"{who} is a member now" if joined else f"approved {who}, not confirmed yet: is it up?")
    return EXIT_OK if joined else EXIT_NODE_ERROR


def cmd_invite(args: argparse.Namespace, client: NodeClient) -> int:
    """A pairing code: start a new node with `meshd up --join CODE`."""
    got = client.invite()
    code, ttl = got.get("code"), got.get("expires_in_s")
    if args.json:
        sys.stdout.write(json.dumps(got) + "\n")
        return EXIT_OK
    print(code)
    print(
        f"on the new machine: meshd up --join {code}   (one use, good for {ttl:.0f} s)",
        file=sys.stderr,
    )
    return EXIT_OK


def _add_members(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("members", parents=[common], help=cmd_members.__doc__)
    p.add_argument("action", nargs="?", choices=["rm"], help="rm: remove a member for good")
    p.add_argument("ref", nargs="?", metavar="NAME|ID", help="the member to remove")
    p.add_argument("--json", action="store_true", help="print the raw lists")
    p.set_defaults(func=cmd_members)
    a = sub.add_parser("approve", parents=[common], help=cmd_approve.__doc__)
    a.add_argument("code", metavar="CODE", help="the approval code the waiting node shows")
    a.add_argument("--id", default="", metavar="ID", help="its id (to choose among several)")
    a.set_defaults(func=cmd_approve)
    i = sub.add_parser("invite", parents=[common], help=cmd_invite.__doc__)
    i.add_argument("--json", action="store_true", help="print the code as JSON")
    i.set_defaults(func=cmd_invite)


def _add_pull(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from .pull import cmd_pull

    p = sub.add_parser(
        "pull", parents=[common],
        help="Download a model from the Hugging Face Hub into this machine's cache.",
    )  # fmt: skip
    p.add_argument(
        "model", metavar="REPO_ID[:QUANT]",
        help="e.g. bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M (GGUF: one quantization, "
        "default the first of Q4_K_M, Q4_K_S, Q4_0, ...), or an MLX/safetensors repo",
    )  # fmt: skip
    p.set_defaults(func=None, local=cmd_pull)


COMMANDS = [
    _add_top, _add_nodes, _add_models, add_place, _add_ls, _add_rm, _add_chat, _add_members,
    add_secret, _add_doctor, _add_pull,
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The ``meshctl`` argument parser (global options work before or after the command)."""
    # Global options live in a parent parser so they are accepted on either side of the
    # subcommand; SUPPRESS keeps a subcommand's absent option from hiding a global one.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--node",
        type=_node,
        default=argparse.SUPPRESS,
        metavar="HOST:PORT",
        help=f"node to ask: host:port, :port, host or a URL (default ${NODE_ENV}, "
        "else 127.0.0.1:7470)",
    )
    add_meshctl_key_flags(common)
    common.add_argument(
        "--timeout",
        type=positive_float,
        default=argparse.SUPPRESS,
        metavar="S",
        help=f"seconds to wait for the node (default {DEFAULT_TIMEOUT:g})",
    )
    parser = argparse.ArgumentParser(
        prog="meshctl",
        parents=[common],
        description="Inspect and drive a meshd cluster through any of its nodes.",
    )
    parser.add_argument("--version", action="version", version=f"meshctl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``meshctl``; returns the process exit code."""
    return reader_may_leave(lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    local = getattr(args, "local", None)
    if local is not None:  # needs no node
        return local(args)
    try:
        base_url = getattr(args, "node", None) or parse_node(None)
    except ValueError as exc:  # a bad $MESHCTL_NODE
        print(f"meshctl: ${NODE_ENV}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        api_key, admin = meshctl_keys(args, base_url)
    except ValueError as exc:  # a key file that cannot be read
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    func: Command = args.func
    try:
        timeout = getattr(args, "timeout", DEFAULT_TIMEOUT)
        with NodeClient(base_url, timeout=timeout, api_key=api_key, admin=admin) as client:
            return func(args, client)
    except NodeUnreachable as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except MeshctlError as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_NODE_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())

"""``meshctl secret new``: a fresh cluster secret, printed or written to a file (0600).

The one ``meshctl`` command about secrets rather than a node: it asks no node. Its
functions live in :mod:`meshd.transport.security`, which imports zmq, so the command
imports them when it runs (``meshctl`` must start in 0.3 s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_secret", "cmd_secret"]

#: ``meshctl``'s exit codes (``meshctl.EXIT_OK``, ``meshctl.EXIT_USAGE``).
_OK, _USAGE = 0, 2


def cmd_secret(args: argparse.Namespace) -> int:
    """Make a fresh cluster secret: print it, or write it to a file (mode 0600)."""
    # imported here: meshctl must start in 0.3 s, and security.py brings zmq
    from meshd.transport.security import SecretError, new_secret, write_secret

    if args.output is None:
        print(new_secret())
        return _OK
    try:
        write_secret(args.output, force=args.force)
    except (SecretError, OSError) as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return _USAGE
    print(
        f"wrote a new cluster secret to {args.output}; copy it to every node and start "
        f"each with `meshd up --secret-file {args.output}`",
        file=sys.stderr,
    )
    return _OK


def add_secret(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``meshctl secret new [-o PATH] [--force]`` (no node options: it asks none)."""
    p = sub.add_parser("secret", help="Cluster secrets (CURVE keys for every socket).")
    ssub = p.add_subparsers(dest="secret_command", metavar="ACTION", required=True)
    new = ssub.add_parser("new", help=cmd_secret.__doc__, description=cmd_secret.__doc__)
    new.add_argument("-o", "--output", type=Path, metavar="PATH", help="write it here")
    new.add_argument("--force", action="store_true", help="replace an existing file")
    p.set_defaults(func=None, local=cmd_secret)

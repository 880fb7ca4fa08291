"""argparse types shared by ``meshd`` and ``meshctl``: a bad value is a usage error
that names it, never a traceback."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    n = _whole(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1")
    return n


def nonnegative_int(text: str) -> int:
    """A whole number >= 0."""
    n = _whole(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} must be 0 or more")
    return n


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def nonnegative_float(text: str) -> float:
    """A number >= 0 (NaN refused)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return x


def positive_float(text: str) -> float:
    """A number > 0 (NaN refused)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0")
    return x


def allowed_host(text: str) -> str:
    """An ``--allow-host`` entry: a host name or address, with an optional ``:PORT``."""
    # imported here: meshctl imports this module, and must start in 0.3 s (the API's
    # modules bring starlette, msgspec and the models' numpy)
    from meshd.api.origins import parse_allowed

    if parse_allowed(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a host name or address [:PORT]")
    return text

"""Logging for every meshd process: one setup, text or JSON lines, request ids.

A request's id (the hex id the API node gives it, which every stage's messages carry)
is set for the code that serves it with :func:`request_scope`; every log line written
inside carries it (``req=<id>`` in text, ``"req"`` in JSON), so ``grep <id>`` over any
node's log shows the request's path: its stages, replays and errors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal

from meshd.domain.text import loggable

__all__ = [
    "LOG_FORMATS",
    "JsonFormatter",
    "configure",
    "configured",
    "current_request",
    "request_scope",
]

LogFormat = Literal["text", "json"]
#: The formats ``--log-format`` takes.
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

_REQUEST: ContextVar[str | None] = ContextVar("meshd_request", default=None)
#: What :func:`configure` last set in this process: the level and format.
_CONFIGURED: tuple[str, LogFormat] = ("info", "text")


def current_request() -> str | None:
    """The id of the request being served here (None: none)."""
    return _REQUEST.get()


@contextlib.contextmanager
def request_scope(req: str | None) -> Iterator[None]:
    """Tag every log line written inside (this task and those it starts) with ``req``."""
    token = _REQUEST.set(req)
    try:
        yield
    finally:
        _REQUEST.reset(token)


class _RequestFilter(logging.Filter):
    """Puts the current request id on each record (an explicit ``extra={"req": ...}``
    wins: a loop serving many requests names the one a line is about)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "req"):
            record.req = _REQUEST.get()
        return True


class _TextFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        # Every line of every logger passes here: a peer's name or reason in a message
        # cannot forge a line nor reach the terminal as an escape (see domain.text).
        record.message = loggable(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        req = getattr(record, "req", None)
        return f"{line} req={req}" if req else line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (Unix seconds), ``level``, ``logger``, ``msg``,
    ``proc`` when the process has a name (a runner's), ``req`` when a request is being
    served, ``exc`` with a traceback."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.proc = name

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": loggable(record.getMessage()),
        }
        if self.proc:
            out["proc"] = self.proc
        req = getattr(record, "req", None)
        if req:
            out["req"] = req
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str = "info", fmt: LogFormat = "text", *, name: str | None = None) -> None:
    """Set up the root logger of this process: ``level``, ``fmt``, on stderr.

    ``name`` (a runner's ``stage 1``, say) prefixes text lines (and is ``proc`` in
    JSON), so a node's log tells its own lines from its runners'.
    """
    global _CONFIGURED
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(name))
    else:
        prefix = f"[{name}] " if name else ""
        text = _TextFormatter(
            prefix + "%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
        text.converter = time.localtime
        handler.setFormatter(text)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # gguf-py tells INFO of every file it writes (a slice cut for a stage): its own
    # details, not the node's news; they show at debug.
    logging.getLogger("gguf").setLevel(
        max(root.level, logging.WARNING) if root.level > logging.DEBUG else logging.DEBUG
    )
    # Python's warnings too, or they would be the lines of a JSON log that are not JSON.
    logging.captureWarnings(True)
    _CONFIGURED = (level, fmt)


def configured() -> tuple[str, LogFormat]:
    """The level and format :func:`configure` set in this process (``("info", "text")``
    before it ran): what a node tells its runners, so that they log as it does."""
    return _CONFIGURED

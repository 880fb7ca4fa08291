"""``meshctl chat``: one question (``meshctl chat PROMPT``), or a session at a terminal.

The session edits its line and keeps its history with the standard library's
``readline`` (GNU readline or libedit: arrow keys, Ctrl-A/E, Ctrl-R; the history is
kept in :func:`history_path` across sessions). Ctrl-C while an answer streams closes
its connection (the node cancels the request on every stage) and the session goes on
with what was shown kept as the answer; Ctrl-C at the prompt clears the line; Ctrl-D
leaves. A thinking model's thoughts are shown apart: dim at a terminal, on stderr when
stdout is not one (a piped answer is the answer alone). Lines that start with ``/`` are
commands (:data:`HELP`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .client import MeshctlError, NodeClient, NodeUnreachable

__all__ = ["HELP", "Conversation", "Shown", "command", "history_path", "run_chat"]

#: ``$MESHCTL_HISTORY``: the history file of chat sessions ("" keeps none).
HISTORY_ENV = "MESHCTL_HISTORY"
#: Lines kept in the history file.
HISTORY_LINES = 1000

HELP = """\
/model NAME   ask NAME from the next question on (the conversation stays)
/system TEXT  set the system prompt (/system alone removes it)
/clear        forget the conversation (the system prompt stays)
/help         this list
Ctrl-C stops an answer (at the prompt: clears the line); Ctrl-D leaves."""

# What a model writes reaches the terminal: no control character but newline and tab
# (an escape sequence could retitle the window, clear it or fake a prompt).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_DIM, _UNDIM = "\x1b[2m", "\x1b[22m"


@dataclass
class Conversation:
    """What the next question is sent with: the model, the system prompt and the
    turns so far."""

    model: str
    system: str = ""
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, question: str) -> list[dict[str, str]]:
        """The messages of a request that asks ``question`` next."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.turns, {"role": "user", "content": question}]

    def answered(self, question: str, answer: str) -> None:
        """Keep a question and its answer (as far as it was shown) for the next ones."""
        self.turns += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]


def command(conv: Conversation, line: str) -> str | None:
    """Run the session command ``line`` on ``conv`` and say what it did; None when the
    line is no command (a question)."""
    if not line.startswith("/"):
        return None
    name, _, arg = line[1:].partition(" ")
    arg = arg.strip()
    if name == "model":
        if not arg:
            return f"model: {conv.model} (/model NAME asks another)"
        conv.model = arg
        return f"model: {arg}"
    if name == "system":
        conv.system = arg
        return f"system prompt: {arg}" if arg else "system prompt removed"
    if name == "clear":
        conv.turns.clear()
        return "conversation cleared"
    if name == "help":
        return HELP
    return f"unknown command /{name}; /help lists them"


class Shown:
    """Writes an answer's deltas as they come: thoughts apart from the answer."""

    def __init__(self, out: TextIO, err: TextIO, terminal: bool) -> None:
        self.out, self.err, self.terminal = out, err, terminal
        self.answer: list[str] = []
        self._thinking = False
        self._wrote = False

    def write(self, kind: str, text: str) -> None:
        """Show one delta (``kind``: ``reasoning`` or ``content``)."""
        text = _CONTROLS.sub("", text)
        if kind == "reasoning":
            if self.terminal:
                self.out.write(_DIM + text + _UNDIM)
                self._thinking = self._wrote = True
                self.out.flush()
            else:
                self.err.write(text)
                self.err.flush()
            return
        if self._thinking:  # the thoughts end where the answer begins
            self.out.write("\n\n")
            self._thinking = False
        self.answer.append(text)
        self.out.write(text)
        self._wrote = True
        self.out.flush()

    def end(self, note: str = "") -> None:
        """End the answer's line (with ``note``, dim at a terminal)."""
        if note:
            self.out.write(
                ("  " if self._wrote else "") + (_DIM + note + _UNDIM if self.terminal else note)
            )
        self.out.write("\n")
        self.out.flush()


def ask(client: NodeClient, conv: Conversation, question: str, params: dict[str, Any]) -> bool:
    """Stream the answer to ``question`` and keep the turn; False when Ctrl-C stopped
    it (what was shown is kept as the answer)."""
    shown = Shown(sys.stdout, sys.stderr, sys.stdout.isatty())
    body = {**params, "model": conv.model, "messages": conv.messages(question)}
    # closing(): a Ctrl-C that lands between two deltas still closes the stream.
    deltas = client.chat_stream(body)
    try:
        with contextlib.closing(deltas):
            for kind, text in deltas:
                shown.write(kind, text)
    except KeyboardInterrupt:
        shown.end("[stopped]")
        conv.answered(question, "".join(shown.answer))
        return False
    except MeshctlError:
        shown.end()
        raise
    shown.end()
    conv.answered(question, "".join(shown.answer))
    return True


def history_path(env: dict[str, str] | None = None) -> Path | None:
    """The history file: ``$MESHCTL_HISTORY`` ("" none), else ``chat_history`` in the
    per-user state folder (``$XDG_STATE_HOME/meshd``, ``~/.local/state/meshd``; on macOS
    ``~/Library/Application Support/meshd``): where XDG keeps histories, apart from a
    node's data dir and its keys."""
    environ = os.environ if env is None else env
    if HISTORY_ENV in environ:
        return Path(environ[HISTORY_ENV]).expanduser() if environ[HISTORY_ENV] else None
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "meshd" / "chat_history"
    state = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "meshd" / "chat_history"


def _line_editing(path: Path | None) -> Callable[[], None]:
    """Turn on ``input()``'s line editing and load the history; the function that
    saves it. Where there is no readline (Windows), plain ``input()``."""
    try:
        import readline
    except ImportError:
        return lambda: None
    readline.set_history_length(HISTORY_LINES)
    if path is None:
        return lambda: None
    with contextlib.suppress(OSError):
        readline.read_history_file(path)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError as exc:
            print(f"meshctl: history not saved to {path}: {exc.strerror}", file=sys.stderr)

    return save


def run_chat(client: NodeClient, conv: Conversation, params: dict[str, Any]) -> int:
    """The interactive session, until Ctrl-D (exit 0)."""
    # Ctrl-C stops an answer: Python turns SIGINT into KeyboardInterrupt only when it
    # started with SIGINT not ignored, and a shell's background job (nohup, `cmd &` in
    # a script) starts with it ignored. The session asked for it: take it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    save = _line_editing(history_path())
    print(f"chatting with {conv.model} via {client.base_url} (/help: commands, Ctrl-D: quit)")
    try:
        while True:
            try:
                line = input("> ").strip()
            except KeyboardInterrupt:  # the line is dropped: a new prompt
                print()
                continue
            except EOFError:
                print()
                return 0
            said = command(conv, line)
            if said is not None:
                print(said)
            elif line:
                _turn(client, conv, line, params)
    finally:
        save()


def _turn(client: NodeClient, conv: Conversation, line: str, params: dict[str, Any]) -> None:
    try:
        ask(client, conv, line, params)
    except NodeUnreachable:
        raise
    except MeshctlError as exc:
        # One failed turn (model loading, unknown model) should not end the session:
        # say why; the unanswered question is not kept.
        print(f"meshctl: {exc}", file=sys.stderr)

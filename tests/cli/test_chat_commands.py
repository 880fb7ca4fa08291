"""``meshctl chat``'s parts that need no node: the session's commands, how an answer's
thoughts are shown apart, where the history goes (the session itself, in a pty against
a cluster: tests/api/test_chat_session.py)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from meshd.cli.chat import HELP, Conversation, Shown, command, history_path


def test_commands_change_the_next_request_and_say_so() -> None:
    conv = Conversation(model="m")
    assert command(conv, "a question") is None
    conv.answered("q1", "a1")
    assert command(conv, "/model other") == "model: other"
    assert command(conv, "/system Be brief.") == "system prompt: Be brief."
    assert conv.messages("q2") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert conv.model == "other"
    assert command(conv, "/clear") == "conversation cleared"
    assert conv.messages("q3")[1:] == [{"role": "user", "content": "q3"}]
    assert command(conv, "/system") == "system prompt removed"
    assert conv.messages("q3") == [{"role": "user", "content": "q3"}]
    assert command(conv, "/help") == HELP and "/model NAME" in HELP
    assert command(conv, "/nope") == "unknown command /nope; /help lists them"


def test_thoughts_are_dim_at_a_terminal_and_on_stderr_in_a_pipe() -> None:
    out, err = io.StringIO(), io.StringIO()
    shown = Shown(out, err, terminal=True)
    for kind, text in [("reasoning", "Hmm, "), ("reasoning", "a greeting."),
                       ("content", "Hello"), ("content", "\x1b]0;pwned\x07 there")]:  # fmt: skip
        shown.write(kind, text)
    shown.end()
    assert (
        out.getvalue() == "\x1b[2mHmm, \x1b[22m\x1b[2ma greeting.\x1b[22m\n\nHello]0;pwned there\n"
    )
    assert "".join(shown.answer) == "Hello]0;pwned there"  # no escape reaches the screen
    out, err = io.StringIO(), io.StringIO()
    shown = Shown(out, err, terminal=False)
    shown.write("reasoning", "Hmm.")
    shown.write("content", "Hello")
    shown.end("[stopped]")
    assert (out.getvalue(), err.getvalue()) == ("Hello  [stopped]\n", "Hmm.")


def test_the_history_file_is_in_the_state_folder_unless_told(tmp_path: Path) -> None:
    if sys.platform != "darwin":  # there: ~/Library/Application Support/meshd
        assert (
            history_path({"XDG_STATE_HOME": str(tmp_path)}) == tmp_path / "meshd" / "chat_history"
        )
    assert history_path({"MESHCTL_HISTORY": str(tmp_path / "h")}) == tmp_path / "h"
    assert history_path({"MESHCTL_HISTORY": ""}) is None

"""``meshctl chat`` at a terminal: a pty driven by pexpect, against the package's
cluster (the default model split over a and b, asked through c).

One session, as a person would use it: an answer stopped with Ctrl-C (the node ends
the request, the session goes on), the next question answered, a command, an unknown
model's error (the session goes on), the last line recalled with the up arrow, Ctrl-C
at the prompt clearing it, Ctrl-D leaving with exit 0 and the history kept on disk.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import NodeProc, metric_total, wait_for

pexpect = pytest.importorskip("pexpect")

pytestmark = pytest.mark.timeout(300)

UP = "\x1b[A"
CTRL_C, CTRL_D = "\x03", "\x04"
PROMPT = "\r\n> "


def test_a_session_stops_an_answer_recalls_a_line_and_leaves(via: NodeProc, tmp_path: Path) -> None:
    history = tmp_path / "history"
    env = {**os.environ, "TERM": "xterm", "MESHCTL_HISTORY": str(history)}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "meshd.cli.meshctl", "--node", via.api.removeprefix("http://"), "chat",
         "--max-tokens", "48", "--temperature", "0.8"],
        env=env, encoding="utf-8", timeout=90, dimensions=(40, 200),
        # Started as a script's background job is (SIGINT ignored): Ctrl-C must still
        # stop an answer (ci50 and ci51 ran the suite so, and it did not).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        child.expect_exact("> ")
        # An answer stopped as soon as it streams: the node ends the request.
        child.sendline("Tell me a very long story about a dragon and a baker.")
        child.expect_exact("baker.\r\n")  # the line as typed, echoed
        child.expect(r"\w\w")  # the answer streams
        child.send(CTRL_C)
        child.expect_exact("[stopped]")
        child.expect_exact(PROMPT, timeout=10)
        wait_for(lambda: metric_total(via, "meshd_requests_in_flight") == 0, 10, 0.1)

        # The session goes on: the next question is answered to its end.
        child.sendline("Say hello.")
        child.expect_exact("hello.\r\n")
        child.expect(r"\w")
        child.expect_exact(PROMPT)
        assert "[stopped]" not in child.before

        # An unknown model is said, and the session goes on.
        child.sendline("/model no-such-model")
        child.expect_exact("model: no-such-model")
        child.sendline("Hi.")
        child.expect("does not exist")
        child.expect_exact(PROMPT)
        child.sendline(f"/model {DEFAULT_MODEL}")
        child.expect_exact(f"model: {DEFAULT_MODEL}")

        # The up arrow recalls the last line; Ctrl-C at the prompt drops it unsent:
        # /help then runs alone (an uncleared line would be "/model .../help").
        child.expect_exact("> ")
        child.send(UP)
        child.expect_exact(f"/model {DEFAULT_MODEL}")
        child.send(CTRL_C)
        child.expect_exact("> ")
        child.sendline("/help")
        child.expect_exact("/system TEXT")
        child.expect_exact(PROMPT)

        child.send(CTRL_D)
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    lines = history.read_text().splitlines()
    assert "Say hello." in lines and "/help" in lines

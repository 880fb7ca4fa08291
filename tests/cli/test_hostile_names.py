"""A name a stranger sends reaches no terminal as an escape, a forged line or markup.

The sanitizers are pure; the sinks are real: one stock node, a script that asks its
join desk in as ``EVIL`` (plain ZeroMQ, as any LAN machine may; the desk refuses the
name), then the node's log, ``meshctl doctor`` (which names refusals) and ``top``'s
frame of a waiting node so named, as they show it.
"""

from __future__ import annotations

import io
import logging
import time

import pytest
import spake2
import zmq
from rich.console import Console

from meshd.cli import meshctl
from meshd.cli.client import NodeClient, displayable
from meshd.cli.top import render
from meshd.domain.text import loggable, printable
from meshd.logs import configure
from meshd.node.joining import APPROVAL_IDS, approval_tag, new_approval_code, normal_code
from meshd.transport import wire
from meshd.transport.identity import NodeKey
from meshd.transport.security import PROTOCOL
from tests.cluster import Cluster, wait_for

#: Clears the screen, sets the window title, forges a log line and a pending entry,
#: turns the rest right-to-left, and carries rich markup.
EVIL = (
    "[bold red]laptop[/]\x1b[2J\x1b]0;pwned\x07\n12:00:00 I meshd.node: approved laptop\r"
    "\u202egnp.exe\u200b\x9b31m " + "x" * 300
)
UNSAFE = ("\x1b", "\x07", "\n", "\r", "\u202e", "\u200b", "\x9b")


def test_printable_and_loggable_leave_nothing_a_terminal_acts_on() -> None:
    shown = printable(EVIL)
    assert not any(c in shown for c in UNSAFE)
    assert len(shown) == 80 and shown.endswith("\u2026")
    assert printable("laptop-2 (mac)") == "laptop-2 (mac)"
    logged = loggable(EVIL)
    assert not any(c in logged for c in UNSAFE if c != "\n")
    assert "\\x1b[2J" in logged and "\\u202e" in logged  # what was sent, readable
    assert all(line.startswith("    ") for line in logged.split("\n")[1:])


def test_every_log_line_of_the_text_format_stays_one_record(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        configure("info", "text")
        logging.getLogger("meshd.node").info("waiting for approval: %s", EVIL)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err and "\r" not in err
    assert [ln for ln in err.splitlines() if ln and not ln.startswith(" ")] == [err.splitlines()[0]]


def _ask_in(port: int, name: str) -> wire.JoinMessage:
    """One JoinHello to a join desk, as a new machine in approval mode sends it (a code
    of its own, its tag); the desk's answer."""
    key = NodeKey.generate()
    a = spake2.SPAKE2_A(normal_code(new_approval_code()).encode(), **APPROVAL_IDS)
    hello = wire.JoinHello(
        name=name, key=key.public, spake=a.start(), protocol=PROTOCOL,
        tag=approval_tag(new_approval_code(), key.public),
    )  # fmt: skip
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send(wire.encode(hello))
        return wire.decode_join(d.recv())
    finally:
        d.close()
        ctx.term()


@pytest.mark.timeout(120)
def test_a_joiners_name_is_refused_and_reaches_the_log_doctor_and_top_defanged(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    a = cluster.start("a", secret=False)
    reply = _ask_in(a.mesh_port + 1, EVIL)
    # The desk takes printable names only: this one waits nowhere...
    assert isinstance(reply, wire.JoinRefused) and reply.code == "bad_name", reply
    with NodeClient(a.api) as client:
        assert not client.members().get("pending")
        cluster_view = client.cluster()
    # ...and where it is named (the refusal, in doctor's report), it is defanged.
    wait_for(lambda: meshctl.main(["--node", a.api, "doctor"]) in (0, 1), 10)
    out = capsys.readouterr().out
    assert "bad_name" in out or "refused" in out, out
    assert not any(c in out for c in UNSAFE if c != "\n")
    # top draws a waiting node's name (as meshctl reads it from a node) as text, never
    # as markup or escapes.
    pending = displayable([{"id": "0123456789abcdef", "name": EVIL, "waiting_s": 1.0}])
    frame = io.StringIO()
    Console(file=frame, width=200, color_system=None, force_terminal=False).print(
        render(cluster_view, [], int(time.time() * 1000), pending)
    )
    text = frame.getvalue()
    assert not any(c in text for c in UNSAFE if c != "\n")
    assert "[bold red]laptop[/]" in text  # shown, not applied
    log = a.log()
    assert "\x1b" not in log and "\u202e" not in log
    assert not any(ln.startswith("12:00:00 I meshd.node: approved") for ln in log.splitlines())

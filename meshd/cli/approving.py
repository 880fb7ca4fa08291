"""Letting a waiting node in, as ``meshctl approve`` and ``meshctl top`` do it.

A node waiting for approval shows an approval code on its own screen (``meshd up``
prints it); the person types that code here. The code is what proves each machine to
the other: a name or an id anyone may claim, so neither is enough on its own (an id
may narrow the choice, as ``top`` does for the row it picked).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .client import MeshctlError, NodeClient

__all__ = ["CodePrompt", "approve_and_wait", "pending_lines", "waiting_line"]

#: How long ``meshctl approve`` waits for the node to confirm the code (it asks again
#: every second, so one that still runs confirms within about one).
CONFIRM_WAIT_S = 15.0


def waiting_line(p: Mapping[str, Any]) -> str:
    """One waiting node, as ``meshctl members`` prints it."""
    state = "approved, confirming the code" if p.get("approving") else "waiting"
    return (
        f"{p.get('name')}  {p.get('id')}  from {p.get('address') or '?'}  "
        f"{state} {p.get('waiting_s')} s"
    )


def pending_lines(pending: Iterable[Mapping[str, Any]]) -> list[str]:
    """The waiting nodes, and how to let one in (nothing when none waits)."""
    lines = [waiting_line(p) for p in pending]
    if not lines:
        return []
    hint = "let one in with `meshctl approve CODE`, CODE being what its `meshd up` shows"
    return ["waiting to join:", *lines, hint]


def approve_and_wait(
    client: NodeClient, code: str, node: str = "", wait_s: float = CONFIRM_WAIT_S
) -> tuple[list[Mapping[str, Any]], bool]:
    """Approve the waiting node that shows ``code`` and wait up to ``wait_s`` for it to
    become a member; the nodes approved, and whether one of them is a member now.
    A refusal (no node shows the code) raises the client's error."""
    got = client.approve(code, node)
    approved: list[Mapping[str, Any]] = list(got.get("data") or [])
    ids = {str(p.get("id")) for p in approved}
    deadline = time.monotonic() + wait_s
    while True:
        ms = client.members().get("data") or []
        if ids & {str(m.get("id")) for m in ms}:
            return approved, True
        if time.monotonic() >= deadline:
            return approved, False
        time.sleep(0.2)


@dataclass
class CodePrompt:
    """``top``'s approve keys: a number picks a waiting node, then the person types the
    code that node's screen shows and Enter approves it (Esc cancels). Nothing is let
    in by one key press."""

    picked: Mapping[str, Any] | None = None
    typed: str = ""

    @property
    def active(self) -> bool:
        """Whether keys go to the code being typed (q is then a letter, not quit)."""
        return self.picked is not None

    def key(self, client: NodeClient, key: str, pending: list[Mapping[str, Any]]) -> str | None:
        """Take one key; the status line to show, or None when the key is not for us."""
        if self.picked is None:
            if not key.isdigit() or not 1 <= int(key) <= len(pending):
                return None
            self.picked, self.typed = pending[int(key) - 1], ""
        elif key == "\x1b":
            self.picked = None
            return "approval cancelled"
        elif key in ("\x7f", "\b"):
            self.typed = self.typed[:-1]
        elif key in ("\r", "\n"):
            return self._approve(client)
        elif (key.isalnum() or key == "-") and key.isascii() and len(self.typed) < 9:
            self.typed += key.upper()
        p = self.picked
        return (
            f"Enter approves, Esc cancels · code {p.get('name')} shows: {self.typed}_ "
            f"(id {p.get('id')})"
        )

    def _approve(self, client: NodeClient) -> str:
        p, self.picked = self.picked or {}, None
        try:
            client.approve(self.typed, str(p.get("id") or ""))
        except MeshctlError as exc:
            return f"not approved: {exc}"
        return f"approved {p.get('name')} ({p.get('id')}); it joins once it confirms the code"

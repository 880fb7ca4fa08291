"""``top``'s approve keys and ``meshctl members``' waiting lines (pure: no node)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from meshd.cli.approving import CodePrompt, pending_lines
from meshd.cli.client import MeshctlError, NodeClient

WAITING: list[Mapping[str, Any]] = [
    {"id": "c776bc40c375c47c", "name": "laptop", "address": "10.0.0.3", "waiting_s": 4.2}
]


class Recorder:
    """Records what would go to ``POST /v1/members``."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[str, str]] = []
        self.refuse = refuse

    def approve(self, code: str, node: str = "") -> dict[str, Any]:
        self.calls.append((code, node))
        if self.refuse:
            raise MeshctlError("HTTP 404: no node waiting here shows the code")
        return {"data": WAITING}


def test_a_number_picks_and_only_the_typed_code_and_enter_approve() -> None:
    p, client = CodePrompt(), cast(NodeClient, Recorder())
    assert p.key(client, "7", WAITING) is None  # no such row
    said = p.key(client, "1", WAITING)
    assert said is not None and "laptop" in said and "Enter approves" in said
    assert cast(Recorder, client).calls == [] and p.active  # one key lets nobody in
    for k in "7kq2-m9xx\x7fdd":  # lower case, a typo erased, a key past the code ignored
        p.key(client, k, WAITING)
    said = p.key(client, "\r", WAITING)
    assert cast(Recorder, client).calls == [("7KQ2-M9XD", "c776bc40c375c47c")]
    assert said is not None and said.startswith("approved laptop") and not p.active


def test_esc_cancels_and_a_refusal_is_said() -> None:
    p, client = CodePrompt(), cast(NodeClient, Recorder(refuse=True))
    p.key(client, "1", WAITING)
    assert p.key(client, "\x1b", WAITING) == "approval cancelled" and not p.active
    p.key(client, "1", WAITING)
    p.key(client, "q", WAITING)  # a letter of the code, not quit, while typing
    said = p.key(client, "\n", WAITING)
    assert said is not None and said.startswith("not approved") and "shows the code" in said


def test_members_lines_name_id_address_and_ask_for_the_code() -> None:
    lines = pending_lines([{**WAITING[0], "approving": True}])
    assert lines[0] == "waiting to join:"
    assert "laptop  c776bc40c375c47c  from 10.0.0.3  approved, confirming" in lines[1]
    assert "meshctl approve CODE" in lines[-1]
    assert pending_lines([]) == []

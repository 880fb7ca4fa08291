"""Admin apart from inference, in process: the route table's access, the guard's answers
(in each dialect's shape), the audit log, the owner token file and meshctl's keys.

The app is the real one (``create_app``, its middleware and handlers) over a node
stand-in that answers only what the admin routes below ask of it; a real node and a
second local user are in tests/api/test_access.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from meshd.api.app import ROUTES, create_app
from meshd.api.auth import ADMIN_HEADER, Access, Guarded
from meshd.api.origins import allowed_hosts
from meshd.api.services import ApiSettings
from meshd.cli import meshd as meshd_cli
from meshd.cli.keys import meshctl_keys, node_keys
from meshd.cli.meshctl import main as meshctl
from meshd.node.member_views import MemberView
from meshd.node.owner import OWNER_FILE, ensure_owner_token, read_owner_token

API, ADMIN_KEY, OWNER = "sk-inference", "admin-remote-key", "o" * 43

#: What changes the cluster: exactly these (method, path) need an admin credential. A
#: route joining or leaving this list is a decision, made here and in app.ROUTES.
ADMIN_ROUTES = {
    ("POST", "/v1/instances"),
    ("DELETE", "/v1/instances/{instance_id}"),
    ("POST", "/v1/members"),
    ("DELETE", "/v1/members/{node_id}"),
    ("POST", "/v1/invites"),
    ("POST", "/api/pull"),
    ("DELETE", "/api/delete"),
}


class Node:
    """The node's side of the routes these tests call (what would change the cluster
    is recorded, not done)."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def invite(self) -> tuple[str, float]:
        self.done.append("invite")
        return "apple-banana-cherry", 300.0

    def remove(self, instance_id: str) -> bool:
        self.done.append(f"remove {instance_id}")
        return True

    def members(self) -> tuple[list[MemberView], list[Any]]:
        return [MemberView(id="n1", name="a", by="n1", at_ms=0)], []


def _app(node: Node, api_key: str | None = API) -> Any:
    settings = ApiSettings(
        api_key=api_key, admin_key=ADMIN_KEY, owner_token=OWNER, max_requests=4,
        max_tokens=16, hosts=allowed_hosts(["127.0.0.1", "testserver"]),
    )  # fmt: skip
    return create_app(node, settings)  # type: ignore[arg-type]  # the routes used only


def _client(app: Any, peer: str = "127.0.0.1") -> TestClient:
    return TestClient(app, base_url="http://127.0.0.1", client=(peer, 50000))


def test_every_route_names_its_access_and_the_admin_ones_are_these() -> None:
    assert all(isinstance(r, Guarded) and isinstance(r.access, Access) for r in ROUTES)
    admin = {(m, r.path) for r in ROUTES if r.access is Access.ADMIN for m in r.methods or ()}
    assert admin == ADMIN_ROUTES
    # Open: the health check, and the web page's files, which hold no secret (its data
    # comes from the routes behind the keys).
    open_routes = [r.path for r in ROUTES if r.access is Access.OPEN]
    assert open_routes == ["/healthz", "/ui", "/ui/", "/ui/{name}"]
    # A route added without an access cannot be served: the app refuses to start.
    ROUTES.append(Route("/v1/new", lambda r: None, methods=["POST"]))  # type: ignore[arg-type]
    try:
        with pytest.raises(TypeError, match="/v1/new"):
            _app(Node())
    finally:
        ROUTES.pop()


def test_admin_needs_the_owner_token_or_the_admin_key(caplog: pytest.LogCaptureFixture) -> None:
    node = Node()
    caplog.set_level(logging.INFO, logger="meshd.audit")
    with _client(_app(node)) as local, _client(_app(node), peer="10.0.0.7") as remote:
        bearer = {"Authorization": f"Bearer {API}"}
        refusals = [
            (local.post("/v1/invites"), 401, "admin_required"),
            (local.post("/v1/invites", headers=bearer), 403, "admin_required"),
            (local.post("/v1/invites", headers={ADMIN_HEADER: API}), 401, "invalid_admin_key"),
            (local.post("/v1/invites", headers={"x-api-key": API}), 403, "admin_required"),
            (remote.post("/v1/invites", headers={ADMIN_HEADER: OWNER}), 403, "owner_token_remote"),
        ]
        for r, status, code in refusals:
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
        msg = refusals[0][0].json()["error"]["message"]
        assert "meshctl" in msg and "--admin-key-file" in msg and "owner" in msg
        assert "inference only" in refusals[1][0].json()["error"]["message"]
        assert node.done == []
        assert local.post("/v1/invites", headers={ADMIN_HEADER: OWNER}).status_code == 201
        assert remote.post("/v1/invites", headers={ADMIN_HEADER: ADMIN_KEY}).status_code == 201
        assert node.done == ["invite", "invite"]
        # The admin credential opens reading too; the API key opens reading only.
        assert local.get("/v1/members", headers={ADMIN_HEADER: OWNER}).status_code == 200
        assert local.get("/v1/members", headers=bearer).status_code == 200
        assert local.get("/v1/members").status_code == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "meshd.audit"]
    assert "POST /v1/invites refused (admin_required) from 127.0.0.1: 401" in lines
    assert "POST /v1/invites refused (owner_token_remote) from 10.0.0.7: 403" in lines
    assert "POST /v1/invites by owner from 127.0.0.1: 201" in lines
    assert "POST /v1/invites by admin key from 10.0.0.7: 201" in lines
    assert len(lines) == 7  # reading is not audited


def test_refusals_take_each_dialects_shape_and_the_audit_line_stays_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="meshd.audit")
    node = Node()
    with _client(_app(node, api_key=None)) as c:
        ollama = c.post("/api/pull", json={"model": "x"})
        assert ollama.status_code == 401 and "meshctl" in ollama.json()["error"]
        # With no API key, inference and reading stay open to whoever reaches the API.
        assert c.get("/v1/members").status_code == 200
        r = c.delete("/v1/instances/i%0Aforged line", headers={ADMIN_HEADER: OWNER})
        assert r.status_code == 200 and node.done == ["remove i\nforged line"]
    lines = [r.getMessage() for r in caplog.records if r.name == "meshd.audit"]
    assert lines[-1] == "DELETE /v1/instances/i\\nforged line by owner from 127.0.0.1: 200"


def test_the_owner_token_is_private_kept_and_replaced_when_exposed(tmp_path: Path) -> None:
    token = ensure_owner_token(tmp_path)
    path = tmp_path / OWNER_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) >= 32
    assert ensure_owner_token(tmp_path) == token == read_owner_token(tmp_path)
    path.chmod(0o644)  # readable by every user: no longer a secret
    fresh = ensure_owner_token(tmp_path)
    assert fresh != token and stat.S_IMODE(path.stat().st_mode) == 0o600
    bait = tmp_path / "bait"
    bait.write_text("x" * 40)
    path.unlink()
    path.symlink_to(bait)  # never read or written through a link
    assert read_owner_token(tmp_path) is None
    assert ensure_owner_token(tmp_path) != "x" * 40 and not path.is_symlink()
    assert bait.read_text() == "x" * 40
    assert read_owner_token(tmp_path / "nowhere") is None


def test_meshctl_sends_the_owner_token_to_loopback_only(tmp_path: Path) -> None:
    token = ensure_owner_token(tmp_path)
    args = argparse.Namespace(data_dir=tmp_path)
    assert meshctl_keys(args, "http://127.0.0.1:7470", env={}) == (None, token)
    assert meshctl_keys(args, "http://[::1]:7470", env={}) == (None, token)
    assert meshctl_keys(args, "http://192.168.1.9:7470", env={}) == (None, None)
    assert meshctl_keys(args, "http://127.evil.example:7470", env={}) == (None, None)
    env = {"MESHD_DATA_DIR": str(tmp_path), "MESHD_API_KEY": API}
    assert meshctl_keys(argparse.Namespace(), "http://localhost:1", env=env) == (API, token)
    # An admin key, from a file or the environment, is sent anywhere, in place of it.
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    args = argparse.Namespace(data_dir=tmp_path, admin_key_file=key_file)
    assert meshctl_keys(args, "http://127.0.0.1:1", env={}) == (None, ADMIN_KEY)
    env = {"MESHD_ADMIN_KEY": ADMIN_KEY}
    assert meshctl_keys(argparse.Namespace(), "http://10.0.0.2:1", env=env) == (None, ADMIN_KEY)


def test_keys_never_come_from_argv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert meshctl(["--api-key", "sk-1", "ls"]) == 2
    assert "ps shows it" in capsys.readouterr().err
    for flag in ("--api-key", "--admin-key"):
        assert meshd_cli.main(["config", "show", flag, "sk-1"]) == 2
        err = capsys.readouterr().err
        assert f"{flag}-file" in err and "ps shows it" in err
    key_file = tmp_path / "k"
    key_file.write_text(API)
    keys = argparse.Namespace(api_key=None, api_key_file=key_file, admin_key=API,
                              admin_key_file=None)  # fmt: skip
    with pytest.raises(ValueError, match="must not be the API key"):
        node_keys(keys)
    keys.admin_key = ADMIN_KEY
    assert node_keys(keys) == (API, ADMIN_KEY)
    keys.api_key = "also"
    with pytest.raises(ValueError, match="given twice"):
        node_keys(keys)
    assert os.environ.get("MESHD_API_KEY") is None

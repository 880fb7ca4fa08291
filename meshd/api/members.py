"""``/v1/members`` and ``/v1/invites``: who is in the cluster, and letting nodes in.

A node that asked to join waits at the join desk of the members it reached; any of
those members approves it by the code its screen shows (``POST /v1/members
{"approve": "CODE"}``, what ``meshctl approve CODE`` sends), or hands out a pairing
code for ``meshd up --join CODE`` (``POST /v1/invites``, ``meshctl invite``).
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshd.node.member_views import NotOwner, NotSecured

from .bodies import parse_body
from .errors import ApiError
from .services import context

__all__ = ["ApproveRequest", "approve", "create_invite", "list_members", "remove_member"]


class ApproveRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Body of ``POST /v1/members``: the approval code the waiting node shows, and
    optionally its id (or a prefix) to choose among several."""

    approve: str
    node: str = ""

    def __post_init__(self) -> None:
        if not self.approve.strip():
            raise ValueError("approve must be the code the waiting node shows")


def _open_cluster(e: NotSecured) -> ApiError:
    return ApiError(409, str(e), type="invalid_request_error", code="open_cluster")


async def list_members(request: Request) -> Response:
    """``GET /v1/members``: the members, and the nodes waiting for approval here."""
    services = context(request).services
    try:
        members, pending = services.members()
    except NotSecured as e:
        raise _open_cluster(e) from None
    return JSONResponse(
        {
            "object": "list",
            "data": msgspec.to_builtins(members),
            "pending": msgspec.to_builtins(pending),
        }
    )


async def approve(request: Request) -> Response:
    """``POST /v1/members``: approve the pending node that shows the code; 202: it is a
    member once it confirms the code (``GET /v1/members`` tells)."""
    body = await parse_body(request, ApproveRequest)
    services = context(request).services
    try:
        got = services.approve(body.approve.strip(), body.node.strip())
    except NotSecured as e:
        raise _open_cluster(e) from None
    except LookupError as e:
        raise ApiError(404, str(e), type="not_found_error", code="not_pending") from None
    return JSONResponse(
        {"object": "approval", "status": "confirming", "data": msgspec.to_builtins(got)},
        status_code=202,
    )


async def remove_member(request: Request) -> Response:
    """``DELETE /v1/members/{ref}``: remove a member for good (by id or name)."""
    ref = request.path_params["node_id"]
    services = context(request).services
    try:
        m = services.remove_member(ref)
    except NotSecured as e:
        raise _open_cluster(e) from None
    except LookupError as e:
        raise ApiError(404, str(e), type="not_found_error", code="not_found") from None
    except NotOwner as e:
        raise ApiError(403, str(e), type="authentication_error", code="not_owner") from None
    return JSONResponse({"id": m.id, "name": m.name, "object": "member", "deleted": True})


async def create_invite(request: Request) -> Response:
    """``POST /v1/invites``: a pairing code, good once, for a few minutes."""
    services = context(request).services
    try:
        code, ttl = services.invite()
    except NotSecured as e:
        raise _open_cluster(e) from None
    return JSONResponse({"code": code, "expires_in_s": ttl}, status_code=201)

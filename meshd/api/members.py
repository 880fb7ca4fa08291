"""``/v1/members`` and ``/v1/invites``: who is in the cluster, and letting nodes in.

A node that asked to join waits at the join desk of the members it reached; any of
those members approves it (``POST /v1/members {"approve": "NAME"}``, what ``meshctl
approve NAME`` sends), or hands out a pairing code for ``meshd up --join CODE``
(``POST /v1/invites``, ``meshctl invite``).
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshd.node.services import NotOwner, NotSecured

from .bodies import parse_body
from .errors import ApiError
from .services import context

__all__ = ["ApproveRequest", "approve", "create_invite", "list_members", "remove_member"]


class ApproveRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Body of ``POST /v1/members``: the pending node to let in (name or id)."""

    approve: str

    def __post_init__(self) -> None:
        if not self.approve.strip():
            raise ValueError("approve must name a pending node")


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
    """``POST /v1/members``: approve a pending node."""
    body = await parse_body(request, ApproveRequest)
    services = context(request).services
    try:
        member = services.approve(body.approve.strip())
    except NotSecured as e:
        raise _open_cluster(e) from None
    except LookupError as e:
        raise ApiError(404, str(e), type="not_found_error", code="not_pending") from None
    return JSONResponse(msgspec.to_builtins(member), status_code=201)


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

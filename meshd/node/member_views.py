"""What the API shows of the cluster's members and of the nodes waiting to join, and
the errors a member route answers with."""

from __future__ import annotations

import msgspec

from meshd.crdt.views import Member

from .joining import Pending

__all__ = ["MemberView", "NotOwner", "NotSecured", "PendingView", "pending_view"]


class NotSecured(Exception):
    """An open cluster has no members to approve or invite."""


class NotOwner(PermissionError):
    """This node is no owner of its cluster: it may not remove another member."""


class MemberView(msgspec.Struct, kw_only=True):
    """A member of the cluster."""

    id: str
    name: str
    #: Who approved it (its own id: it came with the cluster's key).
    by: str
    at_ms: int
    #: May remove members and make owners.
    owner: bool = False

    @classmethod
    def of(cls, m: Member) -> MemberView:
        """The view of a member entry."""
        return cls(id=m.id, name=m.name, by=m.by, at_ms=m.at_ms, owner=m.owner)


class PendingView(msgspec.Struct, kw_only=True):
    """A node waiting at this node's join desk for approval."""

    id: str
    name: str
    waiting_s: float
    #: Where it asks from.
    address: str = ""
    #: A person approved its code; it has not confirmed yet.
    approving: bool = False


def pending_view(p: Pending, now: float) -> PendingView:
    """The view of a node waiting at the join desk."""
    return PendingView(
        id=p.node_id, name=p.name, waiting_s=round(now - p.first_seen, 1),
        address=p.address, approving=p.approving,
    )  # fmt: skip

"""``GET /v1/cluster/stream``: what ``meshctl top`` shows, as Server-Sent Events.

Each event is one :class:`ClusterSnapshot`: the nodes of ``GET /v1/cluster``, the
instance view of ``GET /v1/instances`` and the nodes waiting at this node's join desk
(the ``pending`` of ``GET /v1/members``), each made by the same function as those
routes, so the web page (``/ui``) and ``top`` render one view and derive nothing; and
the models with their holders and instances (``model_view.py``).

The pace is every stream's (``snapshots.py``): a snapshot at once, then one whenever
it differs, at most one every 0.5 s, looked at again at least every 2 s.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from meshd.node.member_views import NotSecured, PendingView

from .cluster import nodes_body
from .instance_view import InstanceList, instance_list
from .model_view import ModelView, model_views
from .services import Services, context
from .snapshots import snapshot_events
from .sse import sse_response

__all__ = ["ClusterSnapshot", "cluster_snapshot", "cluster_snapshots", "stream_cluster"]


class ClusterSnapshot(msgspec.Struct, kw_only=True):
    """One event of ``GET /v1/cluster/stream``."""

    object: Literal["cluster.snapshot"] = "cluster.snapshot"
    #: ``self``, ``cluster`` and ``nodes`` as ``GET /v1/cluster`` gives them.
    cluster: dict[str, Any]
    #: ``GET /v1/instances``: each instance as this node sees it.
    instances: InstanceList
    #: The nodes waiting for approval here (``GET /v1/members``' ``pending``); null in
    #: an open cluster, which approves nobody.
    pending: list[PendingView] | None
    #: Every model a live node holds or an instance serves: who holds it, what serves it.
    models: list[ModelView]


def cluster_snapshot(services: Services) -> ClusterSnapshot:
    """The cluster as ``services``' node sees it now."""
    pending: list[PendingView] | None
    try:
        pending = services.members()[1]
    except NotSecured:
        pending = None
    view = services.view()
    instances = instance_list(view, services.instance_load())
    return ClusterSnapshot(
        cluster=nodes_body(view, services.cluster_name),
        instances=instances,
        pending=pending,
        models=model_views(view, instances.data),
    )


async def stream_cluster(request: Request) -> Response:
    """``GET /v1/cluster/stream`` (a ``HEAD`` gets the headers alone: the stream never
    ends by itself)."""
    if request.method == "HEAD":
        return Response(media_type="text/event-stream")
    return sse_response(cluster_snapshots(context(request).services))


def cluster_snapshots(
    services: Services, clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[bytes]:
    """The events of the stream, until the client goes or the node drains."""
    return snapshot_events(services, lambda: cluster_snapshot(services), clock)

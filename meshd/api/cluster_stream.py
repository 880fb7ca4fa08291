"""``GET /v1/cluster/stream``: what ``meshctl top`` shows, as Server-Sent Events.

Each event is one :class:`ClusterSnapshot`: the nodes of ``GET /v1/cluster``, the
instance view of ``GET /v1/instances`` and the nodes waiting at this node's join desk
(the ``pending`` of ``GET /v1/members``), each made by the same function as those
routes, so the web page (``/ui``) and ``top`` render one view and derive nothing; and
the models with their holders and instances (``model_view.py``).

The pace is the instance stream's (``instances.py``): a snapshot at once, then one
whenever the node signals a change, at most one every ``STREAM_MIN_INTERVAL_S``, and
at least one every ``STREAM_REFRESH_S`` (heartbeats move speeds and ages without a
change signal); a repeat is not sent, and a quiet stream gets a keep-alive comment.
A watcher costs one snapshot every 2 s or so, whatever the number of changes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from meshd.node.member_views import NotSecured, PendingView

from .cluster import nodes_body
from .instance_view import InstanceList, instance_list
from .instances import STREAM_KEEPALIVE_S, STREAM_MIN_INTERVAL_S, STREAM_REFRESH_S
from .model_view import ModelView, model_views
from .services import Services, context
from .sse import SSE_KEEPALIVE, sse_data, sse_response

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


async def cluster_snapshots(
    services: Services, clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[bytes]:
    """The events of the stream, until the client goes or the node drains."""
    last, sent_at = b"", clock()
    while True:
        # Armed before the look: a change made while this snapshot is sent and paced
        # still ends the wait below (the signal wakes only the waiters it finds).
        wake = asyncio.ensure_future(services.changed(STREAM_REFRESH_S))
        try:
            event = sse_data(cluster_snapshot(services))
            now = clock()
            if event != last:
                last, sent_at = event, now
                yield event
            elif now - sent_at >= STREAM_KEEPALIVE_S:
                sent_at = now
                yield SSE_KEEPALIVE
            if services.draining:
                return  # the node is stopping: the page goes on with another node
            await asyncio.sleep(STREAM_MIN_INTERVAL_S)
            await wake
        finally:
            wake.cancel()

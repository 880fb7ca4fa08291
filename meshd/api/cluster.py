"""The node and the cluster as JSON: ``/healthz``, ``/v1/cluster`` and ``/metrics``."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshd.node.cluster import ClusterView
from meshd.node.services import Vitals

from .services import context

__all__ = ["cluster", "cluster_body", "health_body", "healthz", "metrics", "nodes_body"]


def health_body(v: Vitals) -> dict[str, Any]:
    """The body of ``GET /healthz``: ``status`` (``ok``, or ``draining`` for load
    balancers to send elsewhere) and the node's vitals and drop counters."""
    body = msgspec.to_builtins(v)
    body.pop("draining")
    return {"status": "draining" if v.draining else "ok", **body}


def nodes_body(view: ClusterView, cluster_name: str) -> dict[str, Any]:
    """Who answers, the cluster's name and every node with its liveness, heartbeat age,
    card and health: ``GET /v1/cluster`` without the replicated instances (what the
    cluster stream sends beside the instance view, ``cluster_stream.py``)."""
    nodes = []
    for nid, card in sorted(view.cards.items(), key=lambda kv: (kv[1].name, kv[0])):
        age = view.ages.get(nid)
        h = view.healths.get(nid)
        nodes.append(
            {
                "id": nid,
                "name": card.name,
                "liveness": view.liveness.get(nid, "unknown"),
                "heartbeat_age_s": None if age is None else round(age, 3),
                "card": msgspec.to_builtins(card),
                "health": None if h is None else msgspec.to_builtins(h),
            }
        )
    return {"self": view.self_id, "cluster": cluster_name, "nodes": nodes}


def cluster_body(view: ClusterView, cluster_name: str) -> dict[str, Any]:
    """The cluster as this node sees it (the body of ``GET /v1/cluster``)."""
    return {
        **nodes_body(view, cluster_name),
        "instances": [msgspec.to_builtins(i) for i in view.instances.values()],
        # Derived, not replicated: one request's tokens/s placement predicts for each
        # instance from its nodes' measurements now.
        "predicted_tokens_s": {
            iid: view.predicted_tokens_s(i) for iid, i in sorted(view.instances.items())
        },
    }


async def healthz(request: Request) -> JSONResponse:
    """``GET /healthz`` (answered without an API key)."""
    return JSONResponse(health_body(context(request).services.vitals()))


async def cluster(request: Request) -> JSONResponse:
    """``GET /v1/cluster``."""
    services = context(request).services
    return JSONResponse(cluster_body(services.view(), services.cluster_name))


async def metrics(request: Request) -> Response:
    """``GET /metrics`` in Prometheus' text format."""
    services = context(request).services
    services.sync_metrics()
    return Response(
        services.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )

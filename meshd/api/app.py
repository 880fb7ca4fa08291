"""The HTTP API of a node: a Starlette app over the node's views and services."""

from __future__ import annotations

from typing import Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import instances, openai
from .auth import BearerAuth
from .errors import install_error_handlers


class NodeView(Protocol):
    """What the API needs from a node."""

    def cluster_view(self) -> dict: ...

    def health_view(self) -> dict: ...


def create_app(node) -> Starlette:
    """Build the app for one node."""

    async def healthz(request: Request) -> JSONResponse:
        body = node.health_view()
        inference = getattr(node, "inference", None)
        if getattr(inference, "draining", False):
            # Load balancers read this: stop sending here, the node is on its way out.
            body["status"] = "draining"
        return JSONResponse(body)

    async def cluster(request: Request) -> JSONResponse:
        return JSONResponse(node.cluster_view())

    async def metrics(request: Request) -> Response:
        node.sync_metrics()
        return Response(
            node.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    chat, completions, models = openai.routes(node)
    create, list_, get, delete = instances.routes(node)
    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/cluster", cluster, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/instances", list_, methods=["GET"]),
            Route("/v1/instances", create, methods=["POST"]),
            Route("/v1/instances/{instance_id}", get, methods=["GET"]),
            Route("/v1/instances/{instance_id}", delete, methods=["DELETE"]),
        ],
    )
    install_error_handlers(app)
    key = getattr(getattr(node, "config", None), "api_key", None)
    if key:
        app.add_middleware(BearerAuth, key=key)
    return app

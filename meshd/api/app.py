"""The HTTP API of a node: a Starlette app over a read-only view of the node."""

from __future__ import annotations

from typing import Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class NodeView(Protocol):
    """What the API needs from a node."""

    def cluster_view(self) -> dict: ...

    def health_view(self) -> dict: ...


def create_app(node: NodeView) -> Starlette:
    """Build the app for one node."""

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse(node.health_view())

    async def cluster(request: Request) -> JSONResponse:
        return JSONResponse(node.cluster_view())

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": f"no route {request.url.path}", "type": "not_found"}},
            status_code=404,
        )

    async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": f"{request.method} not allowed", "type": "invalid_request"}},
            status_code=405,
        )

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/v1/cluster", cluster, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: method_not_allowed},
    )

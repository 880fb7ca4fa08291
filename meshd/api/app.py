"""The HTTP API of a node: one Starlette app over the node's services.

Every route is a plain function of its request (:mod:`.cluster`, :mod:`.openai`,
:mod:`.instances`); the app carries their :class:`~.services.ApiContext`.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.routing import Route

from . import cluster, embeddings, instances, members, openai
from .auth import BearerAuth
from .errors import install_error_handlers
from .origins import HostOriginGuard
from .services import ApiContext, ApiSettings, Services

__all__ = ["ROUTES", "create_app"]

ROUTES = [
    Route("/healthz", cluster.healthz, methods=["GET"]),
    Route("/metrics", cluster.metrics, methods=["GET"]),
    Route("/v1/cluster", cluster.cluster, methods=["GET"]),
    Route("/v1/models", openai.list_models, methods=["GET"]),
    Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai.completions, methods=["POST"]),
    Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
    Route("/v1/instances", instances.list_instances, methods=["GET"]),
    Route("/v1/instances", instances.create_instance, methods=["POST"]),
    Route("/v1/instances/{instance_id}", instances.get_instance, methods=["GET"]),
    Route("/v1/instances/{instance_id}", instances.delete_instance, methods=["DELETE"]),
    Route("/v1/members", members.list_members, methods=["GET"]),
    Route("/v1/members", members.approve, methods=["POST"]),
    Route("/v1/members/{node_id}", members.remove_member, methods=["DELETE"]),
    Route("/v1/invites", members.create_invite, methods=["POST"]),
]


def create_app(services: Services, settings: ApiSettings) -> Starlette:
    """The app of one node."""
    app = Starlette(routes=list(ROUTES))
    app.state.ctx = ApiContext(services, settings)
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(BearerAuth, key=settings.api_key)
    # Added last, so it runs first: a foreign Host or Origin gets nothing else.
    app.add_middleware(HostOriginGuard, hosts=settings.hosts)
    return app

"""The HTTP API of a node: one Starlette app over the node's services.

Every route is a plain function of its request (:mod:`.cluster`, :mod:`.openai`,
:mod:`.instances`); the app carries their :class:`~.services.ApiContext`.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.routing import Route

from . import anthropic, cluster, doctor, embeddings, instances, members, ollama, openai, responses
from .auth import BearerAuth
from .errors import install_error_handlers
from .origins import HostOriginGuard
from .requestid import RequestIds
from .services import ApiContext, ApiSettings, Services

__all__ = ["ROUTES", "create_app"]

#: The OpenAI routes a client may also reach under /api/v1.
_OPENAI = [
    Route("/v1/models", openai.list_models, methods=["GET"]),
    Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai.completions, methods=["POST"]),
    Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
    Route("/v1/responses", responses.create_response, methods=["POST"]),
]

ROUTES = [
    Route("/healthz", cluster.healthz, methods=["GET"]),
    Route("/metrics", cluster.metrics, methods=["GET"]),
    Route("/v1/cluster", cluster.cluster, methods=["GET"]),
    Route("/v1/doctor", doctor.doctor, methods=["GET"]),
    *_OPENAI,
    # Anthropic Messages (Claude Code adds ?beta=true: the query string is ignored).
    Route("/v1/messages", anthropic.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
    Route("/v1/instances", instances.list_instances, methods=["GET"]),
    Route("/v1/instances", instances.create_instance, methods=["POST"]),
    # Before /v1/instances/{instance_id}, which would take "stream" for an id.
    Route("/v1/instances/stream", instances.stream_instances, methods=["GET"]),
    Route("/v1/instances/{instance_id}", instances.get_instance, methods=["GET"]),
    Route("/v1/instances/{instance_id}", instances.delete_instance, methods=["DELETE"]),
    Route("/v1/members", members.list_members, methods=["GET"]),
    Route("/v1/members", members.approve, methods=["POST"]),
    Route("/v1/members/{node_id}", members.remove_member, methods=["DELETE"]),
    Route("/v1/invites", members.create_invite, methods=["POST"]),
    # Some OpenAI clients (Open WebUI among them) are given a base URL ending in /api/v1.
    *(Route("/api" + r.path, r.endpoint, methods=r.methods) for r in _OPENAI),
    # Ollama, on the same port.
    Route("/", ollama.root, methods=["GET", "HEAD"]),
    Route("/api/version", ollama.version, methods=["GET"]),
    Route("/api/tags", ollama.tags, methods=["GET"]),
    Route("/api/ps", ollama.ps, methods=["GET"]),
    Route("/api/show", ollama.show, methods=["POST"]),
    Route("/api/chat", ollama.chat, methods=["POST"]),
    Route("/api/generate", ollama.generate, methods=["POST"]),
    Route("/api/embed", ollama.embed, methods=["POST"]),
    Route("/api/embeddings", ollama.embeddings, methods=["POST"]),
    Route("/api/pull", ollama.pull, methods=["POST"]),
    Route("/api/delete", ollama.delete, methods=["DELETE"]),
    *(
        Route(path, ollama.not_supported, methods=["POST", "HEAD"])
        for path in ("/api/create", "/api/copy", "/api/push", "/api/blobs/{digest}")
    ),
]


def create_app(services: Services, settings: ApiSettings) -> Starlette:
    """The app of one node."""
    app = Starlette(routes=list(ROUTES))
    app.state.ctx = ApiContext(services, settings)
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(BearerAuth, key=settings.api_key)
    app.add_middleware(HostOriginGuard, hosts=settings.hosts)
    # Added last, so it runs first: every answer, refusals too, carries its id.
    app.add_middleware(RequestIds)
    return app

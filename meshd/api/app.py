"""The HTTP API of a node: one Starlette app over the node's services.

Every route is a plain function of its request (:mod:`.cluster`, :mod:`.openai`,
:mod:`.instances`); the app carries their :class:`~.services.ApiContext`.
"""

from __future__ import annotations

from starlette.applications import Starlette

from . import (
    anthropic,
    cluster,
    cluster_stream,
    doctor,
    embeddings,
    instances,
    members,
    ollama,
    ollama_models,
    openai,
    responses,
    webui,
)
from .accesslog import AccessLog
from .auth import Access, AccessGuard, Guarded
from .errors import install_error_handlers
from .origins import HostOriginGuard
from .requestid import RequestIds
from .services import ApiContext, ApiSettings, Services

__all__ = ["ROUTES", "create_app"]

OPEN, USE, ADMIN = Access.OPEN, Access.USE, Access.ADMIN

#: The OpenAI routes a client may also reach under /api/v1.
_OPENAI = [
    Guarded(USE, "/v1/models", openai.list_models, methods=["GET"]),
    # A model's id may hold "/" (org/repo): the rest of the path is the id.
    Guarded(USE, "/v1/models/{model_id:path}", openai.retrieve_model, methods=["GET"]),
    Guarded(USE, "/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    Guarded(USE, "/v1/completions", openai.completions, methods=["POST"]),
    Guarded(USE, "/v1/embeddings", embeddings.embeddings, methods=["POST"]),
    Guarded(USE, "/v1/responses", responses.create_response, methods=["POST"]),
]

#: Every route, and who may call it (``auth.py``): ``OPEN`` anyone; ``USE`` inference
#: and reading, behind the API key when the node has one (a request for a model not
#: placed still places it); ``ADMIN`` what changes the cluster, with the owner's token
#: or the admin key only. The one table of access: the app refuses a route not in it.
ROUTES: list[Guarded] = [
    Guarded(OPEN, "/healthz", cluster.healthz, methods=["GET"]),
    Guarded(USE, "/metrics", cluster.metrics, methods=["GET"]),
    Guarded(USE, "/v1/cluster", cluster.cluster, methods=["GET"]),
    # What top shows (nodes, instances, who waits to join), at every change: the page's feed.
    Guarded(USE, "/v1/cluster/stream", cluster_stream.stream_cluster, methods=["GET"]),
    # The web page: static files holding no secret; it asks for the keys the API needs
    # (webui.py), so a keyed node must serve it to a browser that has none yet.
    Guarded(OPEN, "/ui", webui.page, methods=["GET", "HEAD"]),
    Guarded(OPEN, "/ui/", webui.page, methods=["GET", "HEAD"]),
    Guarded(OPEN, "/ui/{name}", webui.asset, methods=["GET", "HEAD"]),
    # Probes the peers' ports (bounded) and reports; changes nothing.
    Guarded(USE, "/v1/doctor", doctor.doctor, methods=["GET"]),
    *_OPENAI,
    # Anthropic Messages (Claude Code adds ?beta=true: the query string is ignored).
    Guarded(USE, "/v1/messages", anthropic.messages, methods=["POST"]),
    Guarded(USE, "/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
    Guarded(USE, "/v1/instances", instances.list_instances, methods=["GET"]),
    Guarded(ADMIN, "/v1/instances", instances.create_instance, methods=["POST"]),
    # Before /v1/instances/{instance_id}, which would take "stream" for an id.
    Guarded(USE, "/v1/instances/stream", instances.stream_instances, methods=["GET"]),
    Guarded(USE, "/v1/instances/{instance_id}", instances.get_instance, methods=["GET"]),
    Guarded(ADMIN, "/v1/instances/{instance_id}", instances.delete_instance, methods=["DELETE"]),
    # Who is in (names, ids, the nodes knocking): what /v1/cluster shows a reader anyway.
    Guarded(USE, "/v1/members", members.list_members, methods=["GET"]),
    Guarded(ADMIN, "/v1/members", members.approve, methods=["POST"]),
    Guarded(ADMIN, "/v1/members/{node_id}", members.remove_member, methods=["DELETE"]),
    Guarded(ADMIN, "/v1/invites", members.create_invite, methods=["POST"]),
    # Some OpenAI clients (Open WebUI among them) are given a base URL ending in /api/v1.
    *(Guarded(r.access, "/api" + r.path, r.endpoint, methods=r.methods or ()) for r in _OPENAI),
    # Ollama, on the same port.
    Guarded(USE, "/", ollama.root, methods=["GET", "HEAD"]),
    Guarded(USE, "/api/version", ollama.version, methods=["GET"]),
    Guarded(USE, "/api/tags", ollama_models.tags, methods=["GET"]),
    Guarded(USE, "/api/ps", ollama_models.ps, methods=["GET"]),
    Guarded(USE, "/api/show", ollama_models.show, methods=["POST"]),
    Guarded(USE, "/api/chat", ollama.chat, methods=["POST"]),
    Guarded(USE, "/api/generate", ollama.generate, methods=["POST"]),
    Guarded(USE, "/api/embed", ollama.embed, methods=["POST"]),
    Guarded(USE, "/api/embeddings", ollama.embeddings, methods=["POST"]),
    # Pull places the model (an explicit placement); delete removes its instances.
    Guarded(ADMIN, "/api/pull", ollama_models.pull, methods=["POST"]),
    Guarded(ADMIN, "/api/delete", ollama_models.delete, methods=["DELETE"]),
    # Answered "not supported" whoever asks: they change nothing.
    *(
        Guarded(USE, path, ollama.not_supported, methods=["POST", "HEAD"])
        for path in ("/api/create", "/api/copy", "/api/push", "/api/blobs/{digest}")
    ),
]


def create_app(services: Services, settings: ApiSettings) -> Starlette:
    """The app of one node."""
    loose = [getattr(r, "path", r) for r in ROUTES if not isinstance(r, Guarded)]
    if loose:  # a route nobody decided who may call is not served
        raise TypeError(f"routes with no access named (make them Guarded): {loose}")
    app = Starlette(routes=list(ROUTES))
    app.state.ctx = ApiContext(services, settings)
    install_error_handlers(app)
    app.add_middleware(
        AccessGuard, routes=app.routes, api_key=settings.api_key,
        admin_key=settings.admin_key, owner_token=settings.owner_token,
    )  # fmt: skip
    app.add_middleware(HostOriginGuard, hosts=settings.hosts)
    # Outside every check: a request any of them refuses is logged too.
    app.add_middleware(AccessLog)
    # Added last, so it runs first: every answer, refusals too, carries its id (and so
    # does its log line).
    app.add_middleware(RequestIds)
    return app

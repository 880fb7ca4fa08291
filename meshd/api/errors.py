"""API errors, each in the shape of the dialect the client speaks, and the handlers
that make every failure use it.

Route code raises :class:`ApiError` (usually from a factory below); the handlers that
:func:`install_error_handlers` adds turn it, Starlette's own 404/405, and any
unexpected exception into the body of the request's dialect (:func:`dialect_of`, by
path) with the right status:

* OpenAI (``/v1/...``): ``{"error": {"message", "type", "param", "code"}}``; the
  ``openai`` client maps the status to its exception class (400 ``BadRequestError``,
  404 ``NotFoundError``, 429 ``RateLimitError``, ...) and honours ``Retry-After``.
* Anthropic (``/v1/messages...``): ``{"type": "error", "error": {"type", "message"}}``
  with Anthropic's error types (``invalid_request_error``, ``not_found_error``,
  ``overloaded_error``, ...).
* Ollama (``/api/...``): ``{"error": "message"}``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshd.models import AmbiguousModelError, ModelNotFoundError, UnsupportedModelError, pull_hint
from meshd.node.errors import ModelLoading, RequestFailed
from meshd.placement import PlacementError

from .schemas import ErrorDetail, ErrorResponse

__all__ = [
    "ApiError",
    "Dialect",
    "ErrorType",
    "bad_request",
    "dialect_of",
    "install_error_handlers",
    "internal_error",
    "model_loading",
    "model_not_found",
    "node_error",
    "overloaded",
    "payload_too_large",
    "request_failed",
    "unsupported_media_type",
    "upstream_failed",
]

log = logging.getLogger("meshd.api")

ErrorType = Literal[
    "invalid_request_error",
    "not_found_error",
    "server_error",
    "service_unavailable",
    "rate_limit_error",
    "authentication_error",
]


#: The API dialects a node speaks; each has its own error shape.
Dialect = Literal["openai", "anthropic", "ollama"]


def dialect_of(path: str) -> Dialect:
    """The dialect of a request path (its errors take that dialect's shape)."""
    if path.startswith("/api/") and not path.startswith("/api/v1/"):
        return "ollama"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "openai"


#: Anthropic's error type for each status (its SDK maps the status, the type says why).
_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An error the API answers with, in OpenAI's shape.

    ``retry_after`` (seconds) becomes a ``Retry-After`` header, rounded up to whole
    seconds.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: ErrorType = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type: ErrorType = type
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return (
            f"ApiError({self.status}, {self.message!r}, type={self.type!r}, "
            f"code={self.code!r}, param={self.param!r})"
        )

    def body(self) -> ErrorResponse:
        """The JSON body as a Struct (OpenAI's shape)."""
        return ErrorResponse(
            error=ErrorDetail(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        )

    def body_in(self, dialect: Dialect) -> dict[str, Any]:
        """The JSON body in ``dialect``'s shape."""
        if dialect == "ollama":
            return {"error": self.message}
        if dialect == "anthropic":
            default = "api_error" if self.status >= 500 else "invalid_request_error"
            kind = _ANTHROPIC_TYPES.get(self.status, default)
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return msgspec.to_builtins(self.body())

    def headers(self) -> dict[str, str]:
        """Extra response headers: ``Retry-After`` when set."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(0, math.ceil(self.retry_after)))}

    def to_response(self, dialect: Dialect = "openai") -> JSONResponse:
        """The HTTP response for this error, in ``dialect``'s shape."""
        return JSONResponse(self.body_in(dialect), status_code=self.status, headers=self.headers())


# ---------------------------------------------------------------------------------------
# factories


def bad_request(msg: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request is malformed or asks for something unsupported."""
    return ApiError(400, msg, type="invalid_request_error", param=param, code=code)


def model_not_found(model: str, known: list[str] | None = None) -> ApiError:
    """404 ``model_not_found``: the cluster has no model ``model``; the message lists
    ``known``, the models it serves (None: not looked up)."""
    if known is None:
        served = "GET /v1/models lists the ones it serves."
    elif known:
        more = ", ..." if len(known) > _LISTED else ""
        served = "It serves: " + ", ".join(known[:_LISTED]) + more + "."
    else:
        served = "It serves no model yet (see docs/operations.md to add one)."
    served += pull_hint(model)  # a Hugging Face repo id: how to get it
    return ApiError(
        404,
        f"The model `{model}` does not exist or is not placed in this cluster. {served}",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )


_LISTED = 20  # models named in a not-found message at most (the rest: GET /v1/models)


def model_loading(model: str, retry_after: float, fetching: str = "") -> ApiError:
    """503 ``model_loading``: the model is placed but its runners are not ready yet
    (``fetching``: a stage still fetches its weights from a peer, how far it is)."""
    why = f" (a node is fetching its weights from a peer: {fetching})" if fetching else ""
    return ApiError(
        503,
        f"The model `{model}` is still loading{why}; retry in {max(1, math.ceil(retry_after))}s.",
        type="service_unavailable",
        param="model",
        code="model_loading",
        retry_after=retry_after,
    )


def upstream_failed(msg: str) -> ApiError:
    """502 ``upstream_failed``: a runner or peer node failed the request."""
    return ApiError(502, msg, type="server_error", code="upstream_failed")


def overloaded(retry_after: float) -> ApiError:
    """429 ``overloaded``: too many requests in flight; the client should back off."""
    wait = max(1, math.ceil(retry_after))
    return ApiError(429, f"The node is overloaded; retry in {wait}s.", type="rate_limit_error",
                    code="overloaded", retry_after=retry_after)  # fmt: skip


def payload_too_large(max_bytes: int) -> ApiError:
    """413 ``request_too_large``: the body is over the limit."""
    return ApiError(
        413,
        f"Request body is larger than the limit of {max_bytes} bytes.",
        type="invalid_request_error",
        code="request_too_large",
    )


def unsupported_media_type(content_type: str) -> ApiError:
    """415 ``unsupported_media_type``: the body is not declared as JSON."""
    return ApiError(
        415,
        f"Content-Type must be application/json, got {content_type!r} "
        "(with curl, add -H 'Content-Type: application/json').",
        type="invalid_request_error",
        code="unsupported_media_type",
    )


def internal_error() -> ApiError:
    """500: something unexpected broke; the message says nothing about internals."""
    return ApiError(
        500,
        "The server had an internal error while processing the request; "
        "the node's log has the details.",
        type="server_error",
        code="internal_error",
    )


# ---------------------------------------------------------------------------------------
# what the node raises, in HTTP: one mapping for every route

#: Retry-After given while a model loads, or a request waits for a stage to come back.
LOADING_RETRY_S = 5.0
OVERLOADED_RETRY_S = 1.0  # a 429's, when nothing better is known (limits.Admission)
#: Retry-After while a stage fetches its weights follows the fetch's rate, up to this.
MAX_FETCH_RETRY_S = 60.0


def request_failed(e: RequestFailed) -> ApiError:
    """A request that ended without a result, with its typed code and HTTP status."""
    if e.code == "context_length_exceeded":  # a runner that did not count the prompt
        return ApiError(400, e.message, type="invalid_request_error", param="messages",
                        code="context_length_exceeded")  # fmt: skip
    if e.status == 400:
        return ApiError(400, e.message, type="invalid_request_error", code=e.code)
    if e.status == 503:
        return ApiError(503, e.message, type="service_unavailable", code=e.code,
                        retry_after=LOADING_RETRY_S)  # fmt: skip
    if e.status == 429:  # the stage 0 queue is full: as when this node is
        return overloaded(OVERLOADED_RETRY_S)
    return ApiError(e.status if e.status == 504 else 502, e.message, type="server_error",
                    code=e.code)  # fmt: skip


def node_error(
    e: Exception, model: str, *, placing: bool = False, known: list[str] | None = None
) -> ApiError | None:
    """The HTTP answer to what the node raised while finding, placing or running
    ``model``; None for an exception that is no node error (a bug: a 500).

    ``placing``: an explicit ``POST /v1/instances``, where a model that does not fit
    the cluster as it is conflicts with its state (409, and the not-found message says
    where the node looked); for a completion the model is unavailable (503, and no
    Retry-After: it lasts until a node joins or frees memory).
    """
    if isinstance(e, ModelNotFoundError | AmbiguousModelError):
        if placing:
            return ApiError(404, str(e), type="not_found_error", code="model_not_found")
        return model_not_found(model, known)
    if isinstance(e, ModelLoading):
        # A fetch says how long it still needs; a load has no such figure.
        retry = min(max(LOADING_RETRY_S, e.eta), MAX_FETCH_RETRY_S) if e.eta else LOADING_RETRY_S
        return model_loading(model, retry, e.fetching)
    if isinstance(e, RequestFailed):
        return request_failed(e)
    if isinstance(e, PlacementError):
        msg = str(e) if placing else f"cannot place {model}: {e}"
        if e.reason in ("bad_spec", "unknown_node"):
            return bad_request(msg, param=None if placing else "model", code=e.reason)
        if placing:
            return ApiError(409, msg, type="invalid_request_error", code=e.reason)
        return ApiError(503, msg, type="service_unavailable", code=e.reason)
    if isinstance(e, UnsupportedModelError) and placing:
        return ApiError(
            400, f"{model} cannot run on MLX: {e}", type="invalid_request_error",
            param="engines", code="unsupported_quant",
        )  # fmt: skip
    if isinstance(e, ValueError):  # a file that is no usable model (ModelFormatError), ...
        return bad_request(
            f"{model}: {e}", param="model", code=None if placing else "invalid_model"
        )
    return None


# ---------------------------------------------------------------------------------------
# handlers


_HTTP_TYPES: dict[int, ErrorType] = {
    401: "authentication_error",
    403: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def _from_http_exception(request: Request, exc: HTTPException) -> ApiError:
    status = exc.status_code
    where = f"({request.method} {request.url.path})"
    if status == 404:
        message = f"Invalid URL {where}"
        code = "not_found"
    elif status == 405:
        message = f"Invalid method for URL {where}"
        code = "method_not_allowed"
    else:
        message = exc.detail or "HTTP error"
        code = None
    default: ErrorType = "server_error" if status >= 500 else "invalid_request_error"
    return ApiError(status, message, type=_HTTP_TYPES.get(status, default), code=code)


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.to_response(dialect_of(request.url.path))


async def _http_exception_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = _from_http_exception(request, exc).to_response(dialect_of(request.url.path))
    for key, value in (exc.headers or {}).items():  # e.g. Allow on a 405
        response.headers.setdefault(key, value)
    return response


async def _last_resort_handler(request: Request, exc: Exception) -> Response:
    # Reached only for exceptions raised outside _CatchUnexpected (in middleware added
    # after install_error_handlers); Starlette re-raises afterwards so the server logs it.
    return internal_error().to_response(dialect_of(request.url.path))


class _CatchUnexpected:
    """ASGI middleware: an unexpected exception becomes a logged, opaque 500.

    Unlike Starlette's ServerErrorMiddleware it does not re-raise once the 500 is
    sent, so the traceback is logged once, here, with the request line. When the
    response had already started (a stream), it cannot be replaced: the exception is
    logged and re-raised so the server aborts the connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def _send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, _send)
        except Exception:
            log.exception(
                "unhandled error in %s %s", scope.get("method", "?"), scope.get("path", "?")
            )
            if started:
                raise
            resp = internal_error().to_response(dialect_of(scope.get("path", "")))
            await resp(scope, receive, send)


def install_error_handlers(app: Starlette) -> None:
    """Make every error ``app`` answers use its dialect's shape (:func:`dialect_of`).

    Covers :class:`ApiError`, Starlette's ``HTTPException`` (unknown route 404, wrong
    method 405, ...) and any other exception (500, logged, no internals in the body).
    Call it while building the app, before it serves. Handlers keyed by status code
    (``exception_handlers={404: ...}``) still take precedence over these.
    """
    app.add_exception_handler(ApiError, _api_error_handler)
    app.add_exception_handler(HTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _last_resort_handler)
    app.add_middleware(_CatchUnexpected)

"""Reading a request body into a typed Struct, with every failure an OpenAI-shaped 4xx.

:func:`parse_body` is the one door from untrusted bytes to typed values: it bounds the
size (declared and actual), checks the content type, decodes with msgspec, and maps
every decode or validation failure to :func:`~meshd.api.errors.bad_request` with the
offending field in ``param`` and msgspec's JSON path in the message.
"""

from __future__ import annotations

import asyncio
import re
from typing import TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from .errors import ApiError, bad_request, dialect_of, payload_too_large, unsupported_media_type
from .rules import FieldError

__all__ = ["BODY_TIMEOUT_S", "DEFAULT_MAX_BODY_BYTES", "parse_body", "validation_error"]

#: Default body limit: 8 MiB holds a few hundred thousand tokens of prompt text.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
#: A body must arrive within this (8 MiB at 1 MB/s takes 8 s).
BODY_TIMEOUT_S = 30.0

T = TypeVar("T")

# msgspec appends " - at `$.a.b[0]`" to errors below the root.
_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")
_NOT_OBJECT = re.compile(r"^Expected `object`, got `(?P<got>[^`]+)`$")


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def validation_error(exc: msgspec.ValidationError) -> ApiError:
    """Map a msgspec ``ValidationError`` (from decoding a request) to a 400.

    ``param`` is the field's path without the leading ``$.`` (``messages[0].role``);
    the message keeps msgspec's wording and path (``... - at `$.messages[0].role```).
    """
    text = str(exc)
    m = _AT_PATH.search(text)
    path = m.group("path").removeprefix(".") if m else ""
    cause = exc.__cause__
    if isinstance(cause, FieldError):
        param = _join(path, cause.param)
        return bad_request(f"{cause.reason} - at `$.{param}`", param=param, code=cause.code)
    if m is None and (n := _NOT_OBJECT.match(text)):
        return bad_request(f"Request body must be a JSON object, got {n.group('got')}.")
    if missing := _MISSING.match(text):
        param = _join(path, missing.group("field"))
        return bad_request(
            f"Object missing required field `{missing.group('field')}` - at `$.{param}`",
            param=param,
        )
    return bad_request(text, param=path or None)


def _check_content_type(request: Request) -> None:
    # JSON only, and said so. A web page can send a form, text/plain or a typeless blob
    # cross-site without a CORS preflight; none of those is JSON, so a page the user
    # visits cannot make the node act (see docs/operations.md, "Security").
    raw = request.headers.get("content-type")
    media = raw.split(";", 1)[0].strip().lower() if raw is not None else ""
    if media in ("application/json", "text/json") or media.endswith("+json"):
        return
    if media in _OLLAMA_LOOSE and _ollama_client(request):
        return
    raise unsupported_media_type("none" if raw is None else raw)


#: What Ollama's clients send that is no JSON type: nothing (LiteLLM's ``ollama/``
#: providers), and curl's ``-d`` default (the curls of Ollama's docs).
_OLLAMA_LOOSE = ("", "application/x-www-form-urlencoded")


def _ollama_client(request: Request) -> bool:
    """Whether a body whose Content-Type is in :data:`_OLLAMA_LOOSE` is read as JSON,
    as Ollama reads it: on Ollama's routes, from a client that is no browser. A browser
    marks what it sends for a page (``Origin`` on every post, ``Sec-Fetch-Site``), and
    the Host was checked by :class:`~.origins.HostOriginGuard` (it must be there:
    HTTP/1.0 may leave it out), so a page still cannot post a form or a blob."""
    h = request.headers
    return (
        dialect_of(request.url.path) == "ollama"
        and "host" in h
        and "origin" not in h
        and h.get("sec-fetch-site", "none") in ("same-origin", "none")
    )


def _declared_length(request: Request, max_bytes: int) -> None:
    raw = request.headers.get("content-length")
    if raw is None:
        return
    try:
        declared = int(raw)
    except ValueError:
        raise bad_request(f"Invalid Content-Length header {raw!r}.") from None
    if declared > max_bytes:
        raise payload_too_large(max_bytes)


async def _read_bounded(request: Request, max_bytes: int, timeout: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise payload_too_large(max_bytes)
                chunks.append(chunk)
    except ClientDisconnect:
        raise bad_request("Client disconnected while sending the request body.") from None
    except TimeoutError:
        # A body trickled in byte by byte holds a connection and a handler: bounded.
        raise ApiError(
            408, f"The request body did not arrive within {timeout:g} s.",
            type="invalid_request_error", code="request_timeout",
        ) from None  # fmt: skip
    return b"".join(chunks)


async def parse_body(
    request: Request,
    typ: type[T],
    max_bytes: int = DEFAULT_MAX_BODY_BYTES,
    timeout: float = BODY_TIMEOUT_S,
) -> T:
    """Read ``request``'s JSON body into ``typ`` (a msgspec Struct, usually).

    Raises :class:`~meshd.api.errors.ApiError`:

    * 413 when ``Content-Length`` or the bytes actually received exceed ``max_bytes``
      (checked while streaming, so a lying or absent header does not matter);
    * 408 when the body takes longer than ``timeout`` seconds to arrive;
    * 415 when ``Content-Type`` is absent or not JSON (on Ollama's routes, absent or
      curl's form default is read as JSON from a client that is no browser, as Ollama
      reads it);
    * 400 for an empty body, invalid JSON (or UTF-8), a body that is not an object,
      nesting too deep, a missing or mistyped field, or a field that breaks a rule.

    Unknown fields are ignored (that is msgspec's default and the Structs keep it).
    """
    _check_content_type(request)
    _declared_length(request, max_bytes)
    body = await _read_bounded(request, max_bytes, timeout)
    if not body.strip():
        raise bad_request("Request body is empty; expected a JSON object.")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise validation_error(e) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"Request body is not valid JSON: {e}.", code="invalid_json") from None
    except UnicodeDecodeError:
        # msgspec raises this (not DecodeError) for bad UTF-8 inside a JSON string.
        raise bad_request("Request body is not valid UTF-8.", code="invalid_json") from None
    except RecursionError:
        raise bad_request("Request body JSON is nested too deeply.", code="invalid_json") from None

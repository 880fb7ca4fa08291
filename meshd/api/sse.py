"""Server-Sent Events as OpenAI streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]``.

A stream is a sequence of :func:`sse_data` events, each one chunk Struct, ending with
:data:`SSE_DONE`. A failure after the response has started cannot change the status
code any more, so it is sent as :func:`sse_error` (``data: {"error": {...}}``), which
the ``openai`` client raises as ``APIError``; the stream then ends with
:data:`SSE_DONE` as usual. :data:`SSE_KEEPALIVE` is a comment line clients skip; send
it while a long prompt is being processed so proxies and clients do not time out.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping
from types import MappingProxyType
from typing import Any

import msgspec
from starlette.responses import StreamingResponse

from .errors import ApiError

__all__ = [
    "SSE_DONE",
    "SSE_HEADERS",
    "SSE_KEEPALIVE",
    "SSE_MEDIA_TYPE",
    "sse_data",
    "sse_error",
    "sse_response",
]

#: The event that ends every OpenAI stream.
SSE_DONE = b"data: [DONE]\n\n"
#: A comment event: ignored by clients, keeps idle connections open.
SSE_KEEPALIVE = b": keep-alive\n\n"
#: Media type of a stream (Starlette appends ``; charset=utf-8``).
SSE_MEDIA_TYPE = "text/event-stream"
#: Headers of a stream: no caching anywhere, and no buffering in nginx-like proxies.
SSE_HEADERS: Mapping[str, str] = MappingProxyType(
    {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
)

_encoder = msgspec.json.Encoder()


def sse_data(obj: msgspec.Struct | Mapping[str, Any]) -> bytes:
    """One event carrying ``obj`` as JSON.

    msgspec escapes newlines inside strings, so the JSON is always one ``data:`` line.
    """
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def sse_error(err: ApiError) -> bytes:
    """An error event mid-stream: ``data: {"error": {"message", "type", "param", "code"}}``."""
    return sse_data(err.body())


def sse_response(events: AsyncIterable[bytes], *, status_code: int = 200) -> StreamingResponse:
    """A streaming response with the SSE media type and headers around ``events``."""
    return StreamingResponse(
        events, status_code=status_code, media_type=SSE_MEDIA_TYPE, headers=dict(SSE_HEADERS)
    )

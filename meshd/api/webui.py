"""``/ui``: the web page of the cluster, served by every node on its API port.

The page is static files shipped in the package (``meshd/api/ui/``: HTML, CSS, and
JavaScript modules; no build step). It reads the node's own routes as any client does
(``/v1/cluster/stream``, ``/v1/chat/completions``, ``/v1/members``), with the keys the
person types into it, sent as headers, never as cookies: a page on another site cannot
make the browser send them, and the Origin check (``origins.py``) refuses its requests
anyway. So the page itself holds nothing secret and is open to anyone who reaches the
API (a node with an API key must show the field to type it in).

Every answer carries a strict Content-Security-Policy (scripts, styles and requests of
this origin only, no inline script, no framing), ``nosniff`` and ``no-referrer``: a
name from the network that slipped past the page's escaping still could not run.
"""

from __future__ import annotations

from importlib import resources
from types import MappingProxyType

from starlette.requests import Request
from starlette.responses import Response

from .errors import ApiError

__all__ = ["CSP", "UI_HEADERS", "asset", "page"]

#: What a page of ``/ui`` may load and do: its own files and API, nothing inline.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: Headers of every ``/ui`` answer.
UI_HEADERS = MappingProxyType(
    {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
        "Cross-Origin-Opener-Policy": "same-origin",
        # A node upgraded while a tab is open serves the new files at the next load.
        "Cache-Control": "no-cache",
    }
)
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}


def _load() -> dict[str, bytes]:
    """Every file of the page, by name, read once (a few tens of KB): a request names
    one of these or gets a 404; no path from a request ever reaches the disk."""
    folder = resources.files(__package__ or "meshd.api") / "ui"
    return {
        f.name: f.read_bytes()
        for f in folder.iterdir()
        if f.is_file() and any(f.name.endswith(ext) for ext in _TYPES)
    }


_FILES = _load()


def _answer(name: str, method: str) -> Response:
    body = _FILES.get(name)
    if body is None:
        raise ApiError(404, f"the page has no file {name[:100]!r}", type="not_found_error",
                       code="not_found")  # fmt: skip
    media = _TYPES[name[name.rindex(".") :]]
    resp = Response(b"" if method == "HEAD" else body, media_type=media, headers=dict(UI_HEADERS))
    resp.headers["Content-Length"] = str(len(body))
    return resp


async def page(request: Request) -> Response:
    """``GET /ui``: the page."""
    return _answer("index.html", request.method)


async def asset(request: Request) -> Response:
    """``GET /ui/{name}``: one of the page's scripts and styles."""
    return _answer(request.path_params["name"], request.method)

"""``GET /v1/doctor``: what is wrong with this node and its cluster, and the fixes.

The node does the work (``Services.doctor``: its observations, its peers' ports probed
from here, the pure rules of ``meshd.node.diagnosis``); this route only serves the
report: ``{"node", "name", "findings": [{"severity", "code", "what", "fix"}],
"checked": [{"name", "detail"}]}``, worst finding first.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from .services import context

__all__ = ["doctor"]


async def doctor(request: Request) -> Response:
    """``GET /v1/doctor``."""
    report = await context(request).services.doctor()
    return Response(msgspec.json.encode(report), media_type="application/json")

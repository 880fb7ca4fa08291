"""One log line per request, whatever its outcome: the real middleware (with the request
ids around it, as in the node's app) on an in-process Starlette app."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from meshd.api.accesslog import AccessLog, note_run
from meshd.api.bodies import parse_body
from meshd.api.errors import install_error_handlers, model_not_found
from meshd.api.requestid import RequestIds
from meshd.logs import current_request


class _Body(msgspec.Struct):
    model: str


async def _chat(request: Request) -> Response:
    body = await parse_body(request, _Body)
    if body.model != "m":
        raise model_not_found(body.model, ["m"])
    note_run("chat m via a:0-30: 200, 5 prompt + 1 tokens, first token 0.010s, 0.020s")
    return Response("{}", media_type="application/json")


async def _stream(request: Request) -> Response:
    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
        finally:
            # As answers.streamed counts its runs: once the body is written.
            note_run("chat m via a:0-30: 200, streamed")

    return StreamingResponse(body(), media_type="text/event-stream")


async def _models(request: Request) -> Response:
    return Response("[]", media_type="application/json")


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str, str | None]]:
    """(level, message, request id) of each line the API logs while a test runs."""
    got: list[tuple[int, str, str | None]] = []

    class Keep(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            got.append((record.levelno, record.getMessage(), current_request()))
            return True

    caplog.handler.addFilter(Keep())
    caplog.set_level(logging.DEBUG, logger="meshd.api")
    return got


def _client() -> TestClient:
    routes = [Route("/v1/chat", _chat, methods=["POST"]), Route("/v1/stream", _stream),
              Route("/v1/models", _models)]  # fmt: skip
    app = Starlette(routes=routes)
    install_error_handlers(app)
    app.add_middleware(AccessLog)
    app.add_middleware(RequestIds)
    return TestClient(app)


def test_every_request_is_one_line_with_its_status_and_id(lines) -> None:
    c = _client()
    ok = c.post("/v1/chat", json={"model": "m"}, headers={"X-Request-Id": "served-1"})
    assert ok.status_code == 200
    refused = [
        c.post("/v1/chat", json={"model": "nope"}, headers={"X-Request-Id": "no-model"}),
        c.post("/v1/chat", content=b'{"model": "m"}', headers={"X-Request-Id": "no-type"}),
        c.post("/v1/chat", json={}, headers={"X-Request-Id": "no-field"}),
        c.get("/v1/nowhere", headers={"X-Request-Id": "no-route"}),
    ]
    assert [r.status_code for r in refused] == [404, 415, 400, 404]
    mine = [(level, msg, rid) for level, msg, rid in lines if msg.split()[0] in ("GET", "POST")]
    assert [rid for _, _, rid in mine] == ["served-1", "no-model", "no-type", "no-field",
                                           "no-route"]  # fmt: skip
    assert all(level == logging.INFO for level, _, _ in mine)
    assert mine[0][1].startswith("POST /v1/chat 200 ")
    # What the run reported is on the request's own line, not a line of its own.
    assert mine[0][1].endswith(": chat m via a:0-30: 200, 5 prompt + 1 tokens, "
                               "first token 0.010s, 0.020s")  # fmt: skip
    statuses = [msg.split()[2] for _, msg, _ in mine[1:]]
    assert statuses == ["404", "415", "400", "404"]
    assert all(" from testclient" in msg for _, msg, _ in mine)


def test_a_streamed_run_reports_on_its_requests_line_and_reads_are_quiet(lines) -> None:
    c = _client()
    r = c.get("/v1/stream", headers={"X-Request-Id": "streamed"})
    assert r.status_code == 200 and r.text == "data: 1\n\n"
    assert c.get("/v1/models").status_code == 200
    (line,) = [(lv, m, rid) for lv, m, rid in lines if rid == "streamed"]
    # A GET that ran on the pipeline is a read that succeeded: debug, as any poll.
    assert line[0] == logging.DEBUG
    assert line[1].startswith("GET /v1/stream 200 ")
    assert line[1].endswith(": chat m via a:0-30: 200, streamed")
    (models,) = [m for _, m, _ in lines if m.startswith("GET /v1/models")]
    assert [lv for lv, m, _ in lines if m == models] == [logging.DEBUG]

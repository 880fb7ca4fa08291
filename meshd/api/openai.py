"""OpenAI-compatible routes: chat completions, completions, models.

A request names a model; the node finds its instance (placing one if the model is known
but not placed, and waiting a bounded time for it to load), sends the request to the
pipeline's first stage and turns the DataChunks that come back into OpenAI responses,
streamed as SSE or collected. Errors before the first byte are HTTP errors in OpenAI's
shape; errors after it are an SSE error event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from meshd.models.resolve import AmbiguousModelError, ModelNotFoundError
from meshd.node.config import DEFAULT_MAX_REQUESTS, DEFAULT_MAX_TOKENS
from meshd.node.inference import KEEPALIVE, ModelLoading, RequestFailed
from meshd.placement import PlacementError
from meshd.transport import wire

from . import schemas
from .bodies import parse_body
from .errors import ApiError, bad_request, model_loading, model_not_found, overloaded
from .limits import Admission, Ticket
from .sse import SSE_DONE, SSE_KEEPALIVE, sse_data, sse_error, sse_response

log = logging.getLogger("meshd.api")

#: Retry-After given while a model loads.
LOADING_RETRY_S = 5.0
#: Retry-After given when the node carries its limit of requests.
OVERLOADED_RETRY_S = 1.0
#: Retry-After given while the node drains (stops): another node answers at once.
DRAINING_RETRY_S = 1.0


def _failed(e: RequestFailed) -> ApiError:
    if e.code == "context_length_exceeded":
        return ApiError(400, e.message, type="invalid_request_error", param="messages",
                        code="context_length_exceeded")  # fmt: skip
    if e.status == 400:
        return ApiError(400, e.message, type="invalid_request_error", code=e.code)
    if e.status == 503:
        return ApiError(503, e.message, type="service_unavailable", code=e.code,
                        retry_after=LOADING_RETRY_S)  # fmt: skip
    if e.status == 504:
        return ApiError(504, e.message, type="server_error", code=e.code)
    return ApiError(502, e.message, type="server_error", code=e.code)


class _Run:
    """One request on the pipeline, with its first chunk already in hand."""

    def __init__(self, chunks: AsyncIterator[wire.DataChunk], first: wire.DataChunk) -> None:
        self.chunks = chunks
        self.first = first
        self.n_prompt = first.n_prompt or 0


def routes(node):
    """Handlers bound to ``node``."""
    metrics = node.metrics
    cfg = getattr(node, "config", None)
    admission = Admission(getattr(cfg, "max_requests", DEFAULT_MAX_REQUESTS))
    max_tokens: int = getattr(cfg, "max_tokens", DEFAULT_MAX_TOKENS)

    async def instance_for(model: str):
        try:
            if not node.inference.is_known(model) and node.inference.find_instance(model) is None:
                # Not held by any live node: maybe a path or repo id this node can read.
                await node.inference.facts(model, node.cache_dir)
            return await node.inference.ensure(model, node.cache_dir)
        except (ModelNotFoundError, AmbiguousModelError):
            raise model_not_found(model) from None
        except ModelLoading:
            raise model_loading(model, LOADING_RETRY_S) from None
        except PlacementError as e:
            if e.reason in ("bad_spec", "unknown_node"):
                msg = f"cannot place {model}: {e}"
                raise bad_request(msg, param="model", code=e.reason) from None
            # The cluster as it is cannot hold the model: that lasts until a node joins or
            # frees memory, so no Retry-After invites a client to hammer it every second.
            raise ApiError(503, f"cannot place {model}: {e}", type="service_unavailable",
                           code=e.reason) from None  # fmt: skip
        except RequestFailed as e:
            raise _failed(e) from None
        except ValueError as e:  # a file that is no usable model (ModelFormatError), ...
            raise bad_request(f"{model}: {e}", param="model", code="invalid_model") from None

    async def start(inst, **kw) -> _Run:
        """Send the request and wait for stage 0's acknowledgement (or its error)."""
        chunks = node.inference.generate(inst, **kw)
        try:
            first = await anext(chunks)
        except RequestFailed as e:
            await chunks.aclose()
            raise _failed(e) from None
        except StopAsyncIteration:
            raise ApiError(502, "the pipeline ended without output", type="server_error") from None
        return _Run(chunks, first)

    def sampling(body) -> wire.Sampling:
        n = body.max_new_tokens
        if n is not None and n > max_tokens:
            raise bad_request(
                f"max_tokens is too large: {n}. This node generates at most {max_tokens} "
                "tokens per request (meshd up --max-tokens).",
                param="max_tokens",
                code="max_tokens_too_large",
            )
        return wire.Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            max_tokens=max_tokens if n is None else n,
            stop=body.stop_sequences,
            ignore_eos=body.ignore_eos,
        )

    async def pieces(run: _Run, model: str, t0: float) -> AsyncIterator[wire.DataChunk]:
        """Every chunk after the acknowledgement, with metrics."""
        last = None
        n = 0
        try:
            async for c in run.chunks:
                now = time.perf_counter()
                if c.tokens:
                    for i, sec in enumerate(c.compute):
                        metrics.stage_compute.labels(model, str(i)).observe(sec)
                    if last is None:
                        metrics.ttft.labels(model).observe(now - t0)
                    else:
                        metrics.itl.labels(model).observe(now - last)
                        hops = len(c.compute)  # n stages: n-1 forward hops + 1 back
                        if hops:
                            extra = max(0.0, now - last - sum(c.compute))
                            metrics.hop_overhead.labels(model).observe(extra / hops)
                    last = now
                    n += len(c.tokens)
                yield c
        finally:
            metrics.prompt_tokens.labels(model).inc(run.n_prompt)
            metrics.completion_tokens.labels(model).inc(n)

    async def chat(request: Request) -> Response:
        body = await parse_body(request, schemas.ChatCompletionRequest)
        return await _serve(request, body, chat=True)

    async def completions(request: Request) -> Response:
        body = await parse_body(request, schemas.CompletionRequest)
        return await _serve(request, body, chat=False)

    async def _serve(request: Request, body, chat: bool) -> Response:
        route = "chat" if chat else "completions"
        model = body.model
        t0 = time.perf_counter()
        if node.inference.draining:
            # A stopping node takes no new work: what it accepts now it would have to
            # finish (or cut) within the drain; the client retries on another node.
            metrics.requests.labels(route, model, "503").inc()
            raise ApiError(
                503, "this node is draining (shutting down); send the request to another node",
                type="service_unavailable", code="draining", retry_after=DRAINING_RETRY_S,
            )  # fmt: skip
        ticket = admission.enter()
        if ticket is None:
            metrics.requests.labels(route, model, "429").inc()
            raise overloaded(OVERLOADED_RETRY_S)
        streaming = False
        try:
            try:
                params = sampling(body)
                inst = await instance_for(model)
                if chat:
                    turns = [wire.ChatTurn(m.role, m.text) for m in body.messages]
                    run = await start(inst, messages=turns, sampling=params)
                else:
                    run = await start(inst, prompt=body.prompt_text, sampling=params)
            except ApiError as e:
                metrics.requests.labels(route, model, str(e.status)).inc()
                raise
            metrics.in_flight.inc()
            if body.stream:
                events = _stream(run, body, chat, t0, route, ticket)
                # Backstop: a stream the server never starts (client gone before the
                # first byte) never runs its finally; its slot comes back when freed.
                weakref.finalize(events, ticket.release)
                streaming = True
                return sse_response(events)
            return await _whole(request, run, body, chat, t0, route)
        finally:
            if not streaming:
                ticket.release()

    async def _collect(run: _Run, model: str, t0: float) -> tuple[str, str, wire.Usage | None]:
        text, finish, usage = [], "stop", None
        async for c in pieces(run, model, t0):
            text.append(c.text)
            if c.finish_reason:
                finish, usage = c.finish_reason, c.usage
        return "".join(text), finish, usage

    async def _whole(
        request: Request, run: _Run, body, chat: bool, t0: float, route: str
    ) -> Response:
        model = body.model
        work = asyncio.ensure_future(_collect(run, model, t0))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                # The client left (a timeout, a retry): the answer has no reader, so
                # the stages must stop now, not after max_tokens more tokens.
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, RequestFailed):
                    await work
                metrics.requests.labels(route, model, "client_closed").inc()
                return Response(status_code=499)
            try:
                text, finish, usage = work.result()
            except RequestFailed as e:
                metrics.requests.labels(route, model, str(e.status)).inc()
                raise _failed(e) from None
            u = schemas.Usage.of(usage.prompt_tokens, usage.completion_tokens) if usage else (
                schemas.Usage.of(run.n_prompt, 0))  # fmt: skip
            metrics.requests.labels(route, model, "200").inc()
            if chat:
                resp = schemas.ChatCompletion.single(
                    model=model, content=text, finish_reason=finish, usage=u
                )
            else:
                resp = schemas.Completion.single(
                    model=model, text=text, finish_reason=finish, usage=u
                )
            return Response(_json(resp), media_type="application/json")
        finally:
            gone.cancel()
            # Frees the request on every stage when it did not finish (cancel, error).
            await run.chunks.aclose()
            metrics.in_flight.dec()

    async def _stream(
        run: _Run, body, chat: bool, t0: float, route: str, ticket: Ticket
    ) -> AsyncIterator[bytes]:
        model = body.model
        s = schemas.ChatStream(model) if chat else schemas.CompletionStream(model)
        outcome = "200"
        try:
            if chat:
                yield sse_data(s.start())
            usage = None
            async with contextlib.aclosing(pieces(run, model, t0)) as it:
                async for c in it:
                    if c is KEEPALIVE:
                        # The pipeline broke and the request waits for its repair.
                        yield SSE_KEEPALIVE
                        continue
                    if c.text:
                        yield sse_data(s.content(c.text))
                    if c.finish_reason:
                        usage = c.usage
                        yield sse_data(s.finish(c.finish_reason))
            if body.include_usage and usage is not None:
                yield sse_data(
                    s.usage(schemas.Usage.of(usage.prompt_tokens, usage.completion_tokens))
                )
            yield SSE_DONE
        except RequestFailed as e:
            outcome = str(e.status)
            yield sse_error(_failed(e))
            yield SSE_DONE
        finally:
            ticket.release()
            await run.chunks.aclose()
            metrics.in_flight.dec()
            metrics.requests.labels(route, model, outcome).inc()

    async def list_models(request: Request) -> Response:
        names = node.inference.known_models()
        data = schemas.ModelList(data=[schemas.Model(id=n) for n in names])
        return Response(_json(data), media_type="application/json")

    return chat, completions, list_models


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (its body is already read, so the
    next ASGI message can only be ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _json(obj) -> bytes:
    import msgspec

    return msgspec.json.encode(obj)

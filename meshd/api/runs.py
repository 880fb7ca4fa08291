"""One request on the pipeline as the API sees it, whatever dialect it came in.

A dialect's handler parses its body into a :class:`GenerateRequest` (the one internal
request model: messages or a prompt, and how to sample), then :func:`admit` decides
whether the node takes it (draining: 503, full: 429), finds or places the model's
instance and waits for stage 0's acknowledgement (so errors arrive before the response
starts). The :class:`Run` it returns yields the chunks that follow,
recording the request's metrics; the handler renders them in its own shape, whole
(:meth:`Run.collect`, stopped at once when the client leaves) or streamed. A request
for ``n`` choices is ``n`` runs (:func:`admit_choices`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request

from meshd.crdt.views import Instance
from meshd.domain.chat import ChatTurn, ToolSpec, ToolUse
from meshd.domain.job import Job
from meshd.domain.reasoning import ThinkChoice
from meshd.domain.sampling import SamplingChoice
from meshd.models import canonical_name
from meshd.node.errors import RequestFailed
from meshd.node.metrics import Metrics
from meshd.transport import wire

from .accesslog import note_run, request_started
from .errors import ApiError, bad_request, node_error, overloaded
from .firsttoken import Stamps, observe
from .gone import unless_gone, until_disconnected
from .image_budget import check_images
from .limits import Ticket, current_client
from .overflow import refusal
from .sampling import check_max_tokens, pipeline_sampling
from .services import ApiContext

__all__ = [
    "DRAINING_RETRY_S",
    "Collected",
    "GenerateRequest",
    "Run",
    "admit",
    "admit_choices",
    "choice_request",
    "collect_all_unless_gone",
    "instance_of",
    "unless_gone",
    "until_disconnected",
]

log = logging.getLogger("meshd.api")

#: Retry-After given while the node drains (stops): another node answers at once.
DRAINING_RETRY_S = 1.0
#: The metrics label of a model the cluster does not know.
UNKNOWN_MODEL = "(unknown)"


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """A request for text, in no dialect: what every API adapter parses into."""

    model: str
    #: A chat (rendered with the model's template by stage 0), or a plain prompt.
    messages: list[ChatTurn] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    #: What the dialect calls ``max_tokens`` (errors name it so).
    max_tokens_param: str = "max_tokens"
    sampling: SamplingChoice = field(default_factory=SamplingChoice)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    #: Alternatives to report per token with its log-probability (None: no logprobs).
    logprobs: int | None = None
    #: The grammar the answer must follow (``meshd.engines.grammar``; None: free text).
    grammar: str | None = None
    #: Functions the model may call.
    tools: ToolUse | None = None
    #: A prompt given as token ids (embeddings inputs).
    prompt_tokens: list[int] | None = None
    #: An embedding of the prompt, not a continuation.
    embed: bool = False
    #: Only count the prompt's tokens (stage 0 answers at once with the count).
    count_only: bool = False
    #: Tokens of context a request gets if this request places the model (Ollama's
    #: ``num_ctx``); an instance already placed keeps its own. 0: the default.
    context: int = 0
    #: Seconds the instance stays loaded after this request (Ollama's ``keep_alive``;
    #: ``math.inf`` forever; None: the node's default).
    keep_alive: float | None = None
    #: May start from the KV of an earlier request with the same beginning (None:
    #: yes; see ``Job.cache_prompt``).
    cache_prompt: bool | None = None
    #: May draft tokens for the pipeline to verify (None: see ``Job.speculate``).
    speculate: bool | None = None
    #: The exact mode (``meshd.domain.exact``; None: as the instance says).
    exact: bool | None = None
    #: How the model should think, and more variables for its chat template.
    think: ThinkChoice = field(default_factory=ThinkChoice)
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Collected:
    """A whole answer."""

    text: str
    finish_reason: str
    usage: wire.Usage
    #: Each token's log-probability, when the request asked for them.
    logprobs: list[wire.TokenLogprob] = field(default_factory=list)
    #: An embeddings request's vector (float32, little-endian).
    embedding: bytes = b""
    #: The stop string that ended it, if one did.
    stop_sequence: str | None = None
    #: A thinking model's thoughts, apart from its answer (``text``).
    reasoning: str = ""


class Run:
    """One admitted request with stage 0's acknowledgement in hand."""

    def __init__(
        self,
        chunks: AsyncIterator[wire.DataChunk],
        first: wire.DataChunk,
        *,
        model: str,
        instance: str,
        route: str,
        ticket: Ticket,
        metrics: Metrics,
        t0: float,
        path: str = "",
        tools: Sequence[ToolSpec] = (),
        stamps: Stamps | None = None,
    ) -> None:
        self.chunks = chunks
        self.first = first
        self.n_prompt = first.n_prompt or 0
        #: Prompt tokens stage 0 took from the prefix cache.
        self.n_cached = first.n_cached
        #: How the model writes tool calls (stage 0 says, when the request has tools),
        #: and the functions the request offers.
        self.tool_format = first.tool_format
        self.tools = tools
        self.model = model
        #: The instance's id: ``top``'s figures are per instance (two instances of one
        #: model run at their own speeds), the metrics' labels per model.
        self.instance = instance
        self.route = route
        self.ticket = ticket
        self.metrics = metrics
        #: The stages it runs through (``node:start-end`` each), for the log.
        self.path = path
        self.n_tokens = 0
        #: perf_counter times: the request came in, stage 0 acknowledged it, the first
        #: and the last token arrived (0: not yet). Dialects that report timings use them.
        self.t0 = t0
        self.t_acked = time.perf_counter()
        #: Its times before the first token (its phases: :mod:`.firsttoken`).
        self.stamps = stamps
        self.t_first = 0.0
        self.t_last = 0.0
        self._closed = False
        metrics.queue_wait.labels(model).observe(first.waited_s)
        metrics.in_flight.inc()
        metrics.speed.began(instance)

    async def pieces(self) -> AsyncGenerator[wire.DataChunk, None]:
        """Every chunk after the acknowledgement, recording time to first token,
        inter-token time, per-stage compute and the per-hop overhead."""
        m, model = self.metrics, self.model
        last = None
        n = 0
        try:
            async for c in self.chunks:
                now = time.perf_counter()
                if c.usage is not None and c.usage.drafted_tokens:
                    m.count_drafts(model, c.usage)
                if c.tokens:
                    # A chunk may carry several tokens (the runner coalesces tokens that
                    # come fast, see meshd.engines.outbox; a verified draft brings
                    # several): its times and compute are shared out per token.
                    k = len(c.tokens)
                    stages = [sec / k for sec in c.compute]
                    for i, sec in enumerate(stages):
                        m.stage_compute.labels(model, str(i)).observe(sec)
                    ttft = itl = hop = None
                    if last is None:
                        ttft = now - self.t0
                        m.ttft.labels(model).observe(ttft)
                        if self.stamps is not None:
                            observe(m, model, self.stamps, now, c)
                    else:
                        itl = (now - last) / k
                        m.itl.labels(model).observe(itl)
                        hops = len(stages)  # n stages: n-1 forward hops + 1 back
                        if hops:
                            hop = max(0.0, itl - sum(stages)) / hops
                            m.hop_overhead.labels(model).observe(hop)
                    m.speed.token(self.instance, k, ttft=ttft, itl=itl, stages=stages, hop=hop)
                    last = now
                    self.t_first = self.t_first or now
                    self.t_last = now
                    n += len(c.tokens)
                    self.n_tokens = n
                yield c
        finally:
            m.prompt_tokens.labels(model).inc(self.n_prompt)
            if self.n_cached:
                m.prefix_hits.labels(model).inc()
                m.cached_tokens.labels(model).inc(self.n_cached)
            m.completion_tokens.labels(model).inc(n)

    async def collect(self) -> Collected:
        """The whole answer (raises RequestFailed)."""
        text, thoughts, finish, usage, logprobs, embedding = [], [], "stop", None, [], b""
        matched = None
        async for c in self.pieces():
            text.append(c.text)
            thoughts.append(c.reasoning)
            logprobs += c.logprobs
            embedding = c.embedding or embedding
            if c.finish_reason:
                finish, usage, matched = c.finish_reason, c.usage, c.stop_sequence
        usage = usage or wire.Usage(self.n_prompt, 0)
        return Collected("".join(text), finish, usage, logprobs, embedding, matched,
                         "".join(thoughts))  # fmt: skip

    def count(self, outcome: str) -> None:
        """Count the run's outcome (``200``, a status, ``client_closed``) and report it
        on the request's log line (:mod:`.accesslog`; a line of its own outside a
        request), with the request id as every line for the request."""
        self.metrics.requests.labels(self.route, self.model, outcome).inc()
        ttft = f"{self.t_first - self.t0:.3f}s" if self.t_first else "-"
        summary = (
            f"{self.route} {self.model} via {self.path}: {outcome}, {self.n_prompt} prompt + "
            f"{self.n_tokens} tokens, first token {ttft}, {time.perf_counter() - self.t0:.3f}s"
        )
        if not note_run(summary):
            log.info("%s", summary)

    async def close(self) -> None:
        """Free the request on every stage if it did not finish, give its slot back
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.ticket.release()
        await self.chunks.aclose()  # type: ignore[attr-defined]  # a generator: see _first
        self.metrics.in_flight.dec()
        self.metrics.speed.ended(self.instance)


async def admit(ctx: ApiContext, route: str, req: GenerateRequest) -> Run:
    """Take a request, find (or place) the model's instance and start the request.

    Raises :class:`ApiError` (400 images past their budget, 503 draining, 429 full,
    the node's typed errors); every
    refusal is counted under ``route``. The caller must :meth:`Run.close` the run.
    """
    check_images([b for t in req.messages or () for b in t.images])
    services = ctx.services
    metrics = services.metrics
    # Metrics are labelled by model: only a model the cluster knows becomes a label (a
    # client's made-up names must not grow the registry without bound).
    known = services.view().is_known(req.model)
    model = canonical_name(req.model) if known else UNKNOWN_MODEL
    t0 = time.perf_counter()
    if services.draining:
        # A stopping node takes no new work: what it accepts now it would have to
        # finish (or cut) within the drain; the client retries on another node.
        metrics.requests.labels(route, model, "503").inc()
        raise ApiError(
            503, "this node is draining (shutting down); send the request to another node",
            type="service_unavailable", code="draining", retry_after=DRAINING_RETRY_S,
        )  # fmt: skip
    client = current_client()
    ticket = ctx.admission.enter(client)
    if ticket is None:
        metrics.requests.labels(route, model, "429").inc()
        raise overloaded(ctx.admission.retry_after())
    try:
        max_tokens = check_max_tokens(req.max_tokens, ctx.settings.max_tokens, req.max_tokens_param)
        inst = await instance_of(ctx, req.model, req.context)
        if inst.facts is not None and inst.facts.embedding_only and not req.embed:
            raise bad_request(
                f"model {req.model!r} is an embedding model: it answers POST /v1/embeddings, "
                "not completions",
                param="model",
                code="model_not_generative",
            )
        params = pipeline_sampling(
            req.sampling, inst.facts, max_tokens=max_tokens, stop=req.stop,
            ignore_eos=req.ignore_eos, logprobs=req.logprobs, grammar=req.grammar,
        )  # fmt: skip
        job = Job(
            messages=req.messages, prompt=req.prompt, prompt_tokens=req.prompt_tokens,
            sampling=params, tools=req.tools, embed=req.embed, count_only=req.count_only,
            cache_prompt=req.cache_prompt, speculate=req.speculate, exact=req.exact,
            client=client, think=req.think, template_kwargs=req.template_kwargs,
        )  # fmt: skip
        chunks = services.generate(inst, job, req.keep_alive)
        t_sent = time.perf_counter()
        first = await _first(chunks, lambda e: refusal(e, inst, route, req.max_tokens))
        stamps = Stamps(request_started() or t0, t_sent, time.perf_counter(), first.admit_s)
    except ApiError as e:
        ticket.release()
        metrics.requests.labels(route, model, str(e.status)).inc()
        if e.status == 429:  # stage 0's queue was full (other nodes' requests too)
            raise overloaded(ctx.admission.retry_after()) from None
        raise
    except BaseException:
        ticket.release()
        raise
    model = inst.spec.model  # placed now if it was not: a name the cluster knows
    cards = services.view().cards
    path = " > ".join(
        f"{cards[st.node].name if st.node in cards else st.node[:8]}:{st.start}-{st.end}"
        for st in inst.stages
    )
    return Run(
        chunks, first, model=model, instance=inst.id, route=route, ticket=ticket,
        metrics=metrics, t0=t0, path=path, stamps=stamps,
        tools=req.tools.tools if req.tools is not None else [],
    )  # fmt: skip


async def instance_of(ctx: ApiContext, model: str, context: int = 0) -> Instance:
    """The instance serving ``model`` (placed if needed, with ``context``), or the
    ApiError that says why there is none (an unknown model's lists the models the
    cluster serves)."""
    try:
        return await ctx.services.instance_for(model, context)
    except Exception as e:
        err = node_error(e, model, known=ctx.services.view().known_models())
        if err is None:
            raise
        raise err from None


async def load_only(ctx: ApiContext, model: str, context: int, keep_alive: float | None) -> None:
    """Ollama's request with no prompt: load the model's instance and keep it loaded
    ``keep_alive`` seconds; ``keep_alive`` 0 unloads it instead (``ollama stop``)."""
    inst = ctx.services.view().find_instance(model) if keep_alive == 0 else None
    if inst is None:
        inst = await instance_of(ctx, model, context)
    ctx.services.keep_alive(inst.id, keep_alive)


async def _first(
    chunks: AsyncIterator[wire.DataChunk], refused: Callable[[RequestFailed], ApiError]
) -> wire.DataChunk:
    """Stage 0's acknowledgement, or its refusal as ``refused`` answers it."""
    try:
        return await anext(chunks)
    except RequestFailed as e:
        # Services.generate returns an async generator; its Protocol says AsyncIterator.
        await chunks.aclose()  # type: ignore[attr-defined]  # an async generator
        raise refused(e) from None
    except StopAsyncIteration:
        raise ApiError(502, "the pipeline ended without output", type="server_error") from None


def choice_request(req: GenerateRequest, index: int) -> GenerateRequest:
    """The request of choice ``index`` of ``n``: a seeded request's choices draw from
    ``seed + index``, so they differ from one another and are each reproducible."""
    seed = req.sampling.seed
    if index == 0 or seed is None:
        return req
    sampling = msgspec.structs.replace(req.sampling, seed=(seed + index) & _INT64_MASK)
    return dataclasses.replace(req, sampling=sampling)


#: Seeds stay in the int64 range the wire carries (seed + index may pass its top).
_INT64_MASK = (1 << 63) - 1


async def admit_choices(ctx: ApiContext, route: str, req: GenerateRequest, n: int) -> list[Run]:
    """:func:`admit` ``n`` choices of one request at once (each its own run through the
    pipeline); if any is refused, the others are closed and the refusal raised."""
    if n == 1:
        return [await admit(ctx, route, req)]
    got = await asyncio.gather(
        *(admit(ctx, route, choice_request(req, i)) for i in range(n)), return_exceptions=True
    )
    runs = [g for g in got if isinstance(g, Run)]
    failed = [g for g in got if isinstance(g, BaseException)]
    if failed:
        for r in runs:
            r.count("cancelled")
            await r.close()
        raise failed[0]
    return runs


async def collect_all_unless_gone(runs: list[Run], request: Request) -> list[Collected] | None:
    """Every run's whole answer, or None as soon as the client closes the connection:
    the answers have no reader then, so the stages stop now, not after ``max_tokens``
    more tokens (an SDK's timeout and retry would multiply the work). Raises the first
    RequestFailed."""
    answers = await unless_gone(asyncio.gather(*(r.collect() for r in runs)), request)
    return None if answers is None else list(answers)

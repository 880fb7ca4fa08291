"""Stage 0's admission: a ``Generate`` checked, its prompt rendered and tokenized, a
sequence seated, and the request's first work laid out. Nothing is sent from here:
what to tell the API node and what to run come back to the loop."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from meshd.domain.chat import IMAGE_MARKER, ChatTurn
from meshd.domain.exact import fast_paths
from meshd.domain.job import Job
from meshd.domain.sampling import Sampling
from meshd.engines.grammar import bounded_strings, check_grammar, closed_objects, lark_grammar
from meshd.engines.projector import Projector, ProjectorError
from meshd.engines.protocol import RunnerConfig
from meshd.engines.stage import Stage
from meshd.models.chat import CHATML_TEMPLATE, quote_specials, render_chat, split_quoted
from meshd.models.tools import (
    ToolFormat,
    control_tokens,
    forced_call_lark,
    template_messages,
    tool_format,
    tool_markers,
)
from meshd.transport import wire

from .images import NO_PROJECTOR, ImageRows, image_ids, open_projector, prompt_work
from .seats import Seats
from .state import Refused, Request, Work
from .thinking import Rendered, ThinkSetup


def with_sampling(g: wire.Generate, sampling: Sampling) -> wire.Generate:
    """``g`` sampling with ``sampling``."""
    return msgspec.structs.replace(g, job=msgspec.structs.replace(g.job, sampling=sampling))


def capped(g: wire.Generate, cap: int | None) -> wire.Generate:
    """``g`` with ``max_tokens`` within this runner's ``cap`` (a request from any
    member must not hold a slot for longer than the node allows)."""
    s = g.job.sampling
    if cap is None or (s.max_tokens is not None and s.max_tokens <= cap):
        return g
    return with_sampling(g, msgspec.structs.replace(s, max_tokens=cap))


def reuses_prefix(g: wire.Generate) -> bool:
    """Whether ``g`` may start from a kept prefix: unless it says ``cache_prompt:
    false`` or runs exact, as llama.cpp's server does.

    A reused prefix moves the low bits of the logits (the engine sums a batch of rows
    in another order than the batches that made the prefix: up to ~0.5 on a quantized
    model), so a near-tie may flip between a warm and a cold run; the exact mode
    (:mod:`meshd.domain.exact`) and a replay (its tokens continue exactly) run cold."""
    job = g.job
    reuse = fast_paths(job).prefix_reuse and job.cache_prompt is not False
    return reuse and not g.resume_tokens and not job.embed


def speculates(job: Job, cfg: RunnerConfig) -> bool:
    """Whether ``job`` drafts: never in the exact mode; else as it asks, else as its
    instance says, else where a trip between nodes sets the pace (a split), greedy
    and seeded requests too (the draft budget stops a request where drafts do not
    pay). On one node the draft's extra rows cost about what they save
    (bench/speculate.py: 0.93-0.96x on the default model)."""
    speculate = cfg.speculate if job.speculate is None else job.speculate
    if speculate is None:
        speculate = cfg.n_stages > 1
    allowed = fast_paths(job).speculation and not job.embed
    return allowed and speculate and cfg.draft_max > 0


class Prompts:
    """A model's prompts: chat messages through its template, tools as it writes them,
    images through its projector (None: it reads none, ``no_images`` says why)."""

    def __init__(
        self,
        stage: Stage,
        template: str | None,
        projector: Projector | None = None,
        no_images: str = NO_PROJECTOR,
    ) -> None:
        self.stage = stage
        self.template = template
        self.projector = projector
        self.no_images = no_images
        #: :func:`tool_format` of the template (how this model writes tool calls).
        self.tool_format: ToolFormat = tool_format(template)
        #: Its markers that are control tokens of the model, and their ids: a forced
        #: call writes them as those tokens, and a request with tools shows them.
        self.tool_specials = control_tokens(
            tool_markers(self.tool_format),
            lambda text: stage.tokenize(text, add_special=False, parse_special=True),
            lambda token, special: stage.token_to_piece(token, special=special),
        )
        #: How it thinks, and how a request turns that on or off.
        self.think = ThinkSetup(
            template,
            lambda text: stage.tokenize(text, add_special=False, parse_special=True),
            lambda token, special: stage.token_to_piece(token, special=special),
        )
        # What chat templates get as bos_token / eos_token: the model's own token text,
        # as llama-cpp-python and transformers pass them.
        self.bos_text, self.eos_text = stage.special_texts()

    def tokenize(self, job: Job) -> list[int]:
        """Prompt token ids of ``job``: its chat messages through the model's template,
        or its plain prompt."""
        return self.prompt(job)[0]

    def prompt(self, job: Job) -> tuple[list[int], Rendered]:
        """:meth:`tokenize`, and what rendering settled about the thoughts."""
        tokens, rendered, _ = self.prompt_images(job)
        return tokens, rendered

    def prompt_images(self, job: Job) -> tuple[list[int], Rendered, list[ImageRows]]:
        """:meth:`prompt`, and the rows of its images: their positions hold
        :func:`image_ids` in the token list. :class:`Refused` for images this model
        cannot read."""
        if job.messages is not None:
            if not any(t.images for t in job.messages):
                return (*self._chat(job, job.messages), [])
            return self._chat_images(job, job.messages)
        return (*self._plain(job), [])

    def _plain(self, job: Job) -> tuple[list[int], Rendered]:
        n_vocab = self.stage.n_vocab
        if job.prompt_tokens is not None:
            bad = [t for t in job.prompt_tokens if not 0 <= t < n_vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside [0, {n_vocab})")
            return list(job.prompt_tokens), Rendered(on=False)
        tokens = self.stage.tokenize(job.prompt or "", add_special=True, parse_special=False)
        return list(tokens), Rendered(on=False)

    def _chat(self, job: Job, turns: list[ChatTurn]) -> tuple[list[int], Rendered]:
        runs, bos, rendered = self._render(job, turns)
        if not any(quoted for _, quoted in runs):  # as it always was: no quote to honour
            plain = "".join(run for run, _ in runs)
            tokens = self.stage.tokenize(plain, add_special=not bos, parse_special=True)
            return list(tokens), rendered
        out: list[int] = []
        for i, (run, quoted) in enumerate(runs):
            add = i == 0 and not bos
            out += self.stage.tokenize(run, add_special=add, parse_special=not quoted)
        return out, rendered

    def _chat_images(
        self, job: Job, turns: list[ChatTurn]
    ) -> tuple[list[int], Rendered, list[ImageRows]]:
        """:meth:`_chat` of turns with images: the text between them tokenized, each
        image's chunks (its rows, and the tokens a projector wraps them in) in place."""
        if self.projector is None:
            raise Refused("no_projector", self.no_images)
        for i, t in enumerate(turns):
            if t.content.count(IMAGE_MARKER) != len(t.images):
                raise Refused("bad_prompt", f"messages[{i}] has {len(t.images)} images "
                              f"but {t.content.count(IMAGE_MARKER)} places for them")  # fmt: skip
        images = [b for t in turns for b in t.images]
        runs, bos, rendered = self._render(job, turns)
        if sum(run.count(IMAGE_MARKER) for run, _ in runs) != len(images):
            raise Refused(
                "bad_prompt", "the chat template dropped or repeated a message with an image"
            )
        out: list[int] = []
        rows: list[ImageRows] = []
        pending = iter(images)
        first = True
        for run, quoted in runs:
            for k, piece in enumerate(run.split(IMAGE_MARKER)):
                if k:
                    self._image(next(pending), out, rows)
                if piece or first:
                    add = first and not bos
                    out += self.stage.tokenize(piece, add_special=add, parse_special=not quoted)
                    first = False
        return out, rendered, rows

    def _image(self, image: bytes, out: list[int], rows: list[ImageRows]) -> None:
        """Put ``image``'s chunks at the end of ``out`` (its rows in ``rows``)."""
        assert self.projector is not None
        try:
            chunks = self.projector.chunks(image)
        except ProjectorError as e:
            raise Refused("bad_image", f"cannot read the image: {e}") from e
        for c in chunks:
            if c.ndim == 1:
                out += [int(t) for t in c]
            else:
                rows.append(ImageRows(len(out), c))
                out += image_ids(image, len(c))

    def _render(
        self, job: Job, turns: list[ChatTurn]
    ) -> tuple[list[tuple[str, bool]], bool, Rendered]:
        """The prompt text as runs of (text, quoted), whether it starts with the BOS
        already, and what rendering settled about the thoughts."""
        # Every string the request brought has its special-token text quoted, so that
        # only the template's own special tokens become special ids (models/chat.py).
        rendered = self.think.render(job, turns, lambda v: quote_specials(v, self._specials_in))
        messages = quote_specials([m.as_dict() for m in turns], self._specials_in)
        tools = None
        offered = job.tools.tools if job.tools is not None else []
        if offered or any(m.tool_calls or m.role == "tool" for m in turns):
            messages, tools = template_messages(
                messages,
                quote_specials([msgspec.to_builtins(t) for t in offered], self._specials_in),
                self.tool_format,
            )
        text = render_chat(
            self.template or CHATML_TEMPLATE,
            self.think.soft_off(job, rendered, messages),
            add_generation_prompt=True,
            bos_token=self.bos_text,
            eos_token=self.eos_text,
            **{**rendered.variables, "tools": tools or None},
        )
        runs = split_quoted(self.think.settle(job, rendered, text))
        # A template that writes {{ bos_token }} already starts with the BOS; adding
        # the vocabulary's own BOS too would double it (llama.cpp warns, and output
        # quality drops). Otherwise the vocabulary decides, as for a plain prompt.
        bos = bool(self.bos_text) and bool(runs) and runs[0][0].startswith(self.bos_text)
        return runs, bos, rendered

    def _specials_in(self, text: str) -> list[str]:
        """The special-token texts in ``text`` (a user's): those the tokenizer turns
        into a control token when it parses special tokens, and only then."""
        if not text:
            return []
        parsed = self.stage.tokenize(text, add_special=False, parse_special=True)
        plain = self.stage.tokenize(text, add_special=False, parse_special=False)
        if parsed == plain:
            return []
        piece = self.stage.token_to_piece
        return [
            piece(t, special=True).decode("utf-8", "replace")
            for t in set(parsed) - set(plain)
            if not piece(t, special=False) and piece(t, special=True)
        ]

    def shown_specials(self, job: Job, thinking: bool = False) -> list[int]:
        """The control tokens ``job``'s text shows as text: its tool format's markers
        when it offers tools (the API node reads the calls by them), and its thoughts'
        markers when it ``thinking`` (the last stage splits the output by them)."""
        shown = set(self.tool_specials.values()) if job.tools is not None else set()
        if thinking:
            shown.update(self.think.specials.values())
        return sorted(shown)

    def sampling(self, job: Job, rendered: Rendered, tool_grammar: str | None) -> Sampling:
        """``job``'s sampling as stage 0 decides it for the last stage, whatever the
        request carried: a forced call's grammar, the control tokens shown, the
        thoughts and the tokens the output starts with."""
        s = job.sampling
        grammar = "tool" if tool_grammar is not None else "json" if s.grammar else None
        thinking = self.think.thinking(job, rendered, grammar)
        # A test script decides how the output starts, thoughts and all.
        forced = rendered.script or self.think.opener(thinking, grammar)
        decided = {
            "grammar": tool_grammar or s.grammar,
            "shown_specials": self.shown_specials(job, thinking is not None),
            "thinking": thinking,
            "forced": forced,
        }
        changed = {k: v for k, v in decided.items() if getattr(s, k) != v}
        return msgspec.structs.replace(s, **changed) if changed else s

    def tool_grammar(self, job: Job) -> str | None:
        """The grammar that constrains ``job``'s output to one call when its
        ``tool_choice`` forces one (``required`` or a function's name), else None;
        ValueError for a name not among its tools."""
        if job.tools is None or job.tools.choice == "auto":
            return None
        tools = job.tools.tools
        name = None if job.tools.choice == "required" else job.tools.choice
        if name is not None and all(t.name != name for t in tools):
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        # The call's arguments: strings bounded as in structured outputs, and no
        # argument the function does not declare.
        shown: list[dict[str, object]] = []
        for t in tools:
            d = msgspec.to_builtins(t)
            if t.parameters is not None:
                d["parameters"] = bounded_strings(closed_objects(t.parameters))
            shown.append(d)
        grammar = lark_grammar(forced_call_lark(shown, self.tool_format, name, self.tool_specials))
        check_grammar(grammar)
        return grammar


def prompts_for(cfg: RunnerConfig, stage: Stage, template: str | None) -> Prompts:
    """Stage 0's :class:`Prompts`, with the model's image projector where it has one."""
    return Prompts(stage, template, *open_projector(cfg, stage))


@dataclass
class Admitted:
    """A request stage 0 took: its state, what its first activation carries to the
    later stages, and the work to queue (the prompt, then a replay's tokens)."""

    request: Request
    start: wire.Start
    work: list[Work]
    speculate: bool


def admit(
    g: wire.Generate, prompts: Prompts, seats: Seats, cfg: RunnerConfig, n_ctx: int
) -> Admitted | int:
    """Take ``g`` at stage 0: an :class:`Admitted`, or the prompt's token count for a
    request that only counts it (nothing is held then). :class:`Refused` says why not."""
    stage = prompts.stage
    if not g.job.embed and not stage.generative:
        raise Refused(
            "not_generative", "this model is an embedding model: it embeds, it does not generate"
        )
    try:
        g.job.sampling.check(stage.n_vocab)
        grammar = prompts.tool_grammar(g.job)
    except ValueError as e:
        raise Refused("bad_sampling", str(e)) from e
    try:
        prompt, rendered, images = prompts.prompt_images(g.job)
    except Refused:
        raise
    except Exception as e:
        raise Refused("bad_prompt", f"cannot tokenize the prompt: {e}") from e
    sampling = prompts.sampling(g.job, rendered, grammar)
    if sampling is not g.job.sampling:
        g = with_sampling(g, sampling)
    job = g.job
    n = len(prompt)
    if n == 0:
        raise Refused("bad_prompt", "the prompt is empty")
    if job.count_only:
        return n
    # A replay re-prefills the prompt plus the tokens the client already has.
    resume = list(g.resume_tokens)
    if n + len(resume) >= n_ctx:
        raise Refused(
            "context_length_exceeded",
            f"this model's context is {n_ctx} tokens; the prompt has {n + len(resume)}",
            n_prompt=n + len(resume),
        )
    # A recurrent state cannot be cut back to a shared prefix (meshd.domain.recurrent).
    reuse = reuses_prefix(g) and not stage.recurrent
    # Where a sequence's cells lie in the shared KV buffer moves them too (by ~0.8
    # when kept sequences push them past a 256-cell boundary): a request that
    # reuses nothing runs as on a fresh runner, every stage's kept prefixes dropped.
    cold = not reuse and not job.embed
    if cold:
        seats.drop_all_kept()
    seq, source, n_cached = seats.seat_first(prompt if reuse else None)
    r = Request(
        g.req, seq, list(g.route), g.reply_to, job.sampling, n_prompt=n,
        generation=g.generation, embed=job.embed, slot=seq, n_cached=n_cached, source=source,
        tokens=None if job.embed else [*prompt, *resume], client=job.client,
        exact=not fast_paths(job).narrow_hops,
    )  # fmt: skip
    start = wire.Start(
        route=r.route, reply_to=r.reply_to, sampling=r.sampling, n_prompt=n, resume=resume,
        embed=job.embed, slot=seq, prefix_slot=source, prefix_n=n_cached, cold=cold,
        exact=r.exact,
    )  # fmt: skip
    work = (
        [prompt_work(g.req, prompt, images, n_cached, start)]
        if images
        else [Work(g.req, n_cached, tokens=np.asarray(prompt[n_cached:], np.int32), start=start)]
    )
    # The tokens already sent go through one decode step each, as they did the first
    # time: prefilling them in one batch runs other kernels (other float sums), and
    # a near-tie could then flip, so the continuation would not be the text the
    # uninterrupted request gives. One row a step costs a few ms per token.
    work += [Work(g.req, n + i, tokens=np.array([t], np.int32)) for i, t in enumerate(resume)]
    # Nor can it drop a rejected draft: such a model never speculates.
    # Nor does a prompt with images: its token list has ids no model drafts from.
    spec = speculates(job, cfg) and not stage.recurrent and not images
    return Admitted(r, start, work, spec)


def join(a: wire.Activation, s: wire.Start, seats: Seats) -> Request:
    """A later stage: the request whose first activation ``a`` is (``s``: what stage 0
    said of it), seated. :class:`Refused` when this stage cannot seat it."""
    seq = seats.seat(s)
    return Request(
        a.req, seq, list(s.route), s.reply_to, s.sampling, s.n_prompt,
        generation=a.generation, embed=s.embed, slot=s.slot, n_cached=s.prefix_n,
        exact=s.exact,
    )  # fmt: skip

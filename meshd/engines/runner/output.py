"""The last stage's output: a token drawn from each step's logits (a draft verified
row by row), its text streamed to the API node, and the request ended on a stop, its
length or an error; an embeddings request's vector pooled.

Text goes out through :class:`.links.Links`; how a request ends (what to release and
with which chunk) comes back to the loop as an :class:`Ended`."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import numpy as np

from meshd.engines.constraint import Constraint, GrammarVocab
from meshd.engines.detok import TextStream, showing
from meshd.engines.sampling import Draw, Sampler
from meshd.engines.stage import Stage, StageInput
from meshd.models.pooling import Pooling, pool, pooling_of
from meshd.transport import wire

from .links import Links
from .state import Request, Work
from .thinking import ThoughtTrack

log = logging.getLogger("meshd.runner")


@dataclass
class Ended:
    """How a request ended here: the loop sends ``chunk`` (or the typed ``error``)
    and then releases it with ``reason``, keeping its first ``n_kv`` positions."""

    reason: str
    n_kv: int = -1
    chunk: wire.DataChunk | None = None
    error: tuple[str, str] | None = None


#: What a step's output asks of the loop: a request that ended, a token to feed
#: back at a position, or nothing (a chained step held whole: stage 0 was told).
Next = Ended | tuple[int, int] | None


class Output:
    """Sampling and output of the last stage."""

    def __init__(self, stage: Stage, n_ctx: int, model_path: str, links: Links) -> None:
        self.stage = stage
        self.n_ctx = n_ctx
        self.model_path = model_path
        self.links = links
        self.eos: set[int] = set(stage.eos_tokens())
        self._grammar_vocab: GrammarVocab | None = None

    def init(self, r: Request, resume: list[int]) -> None:
        """Sampling state of a request; a replay primes it with the tokens already sent,
        so held-back UTF-8 bytes and partial stop strings continue exactly, and the
        sampler starts at the position of the first new token, so a seeded stream
        draws what the uninterrupted run would have drawn. ValueError: a grammar the
        vocabulary cannot follow."""
        s = r.sampling
        s.check(self.stage.n_vocab)
        r.sampler = Sampler(s, position=len(resume), history=resume)
        r.text = TextStream(showing(self.stage.token_to_piece, s.shown_specials), list(s.stop))
        r.n_generated = len(resume)
        r.replay_end = r.n_prompt + len(resume)
        if s.thinking is None and not s.forced:
            r.text.prime(resume)
            if s.grammar is not None:
                r.constraint = Constraint(self.grammar_vocab(), s.grammar, resume)
            return
        # Compiled now even where it waits for the thoughts to end: a grammar the
        # vocabulary cannot follow fails the request before its first token.
        grammar = Constraint(self.grammar_vocab(), s.grammar) if s.grammar is not None else None
        waits = grammar is not None and s.thinking is not None and s.thinking.on
        r.track = ThoughtTrack(s.thinking, s.forced, grammar if waits else None)
        r.constraint = None if waits else grammar
        for tok in resume:  # the replay's tokens went as the uninterrupted run made them
            r.track.forced()
            if r.constraint is not None and tok not in self.eos:
                r.constraint.accept(tok)
            self._advance(r, r.text.push(tok)[0])

    def grammar_vocab(self) -> GrammarVocab:
        """The vocabulary as the grammar engine reads it (built on first use)."""
        if self._grammar_vocab is None:
            self._grammar_vocab = GrammarVocab(self.stage)
        return self._grammar_vocab

    def token_logprob(self, d: Draw) -> wire.TokenLogprob:
        """``d`` for the wire, each token with its bytes (special tokens as their text)."""

        def piece(t: int) -> bytes:
            return self.stage.token_to_piece(t, special=True)

        top = [wire.TopLogprob(t, lp, piece(t)) for t, lp in d.top]
        return wire.TokenLogprob(token=d.token, logprob=d.logprob, piece=piece(d.token), top=top)

    def after(self, r: Request, w: Work, logits: np.ndarray, compute: list[float]) -> Next:
        """What a step's logits give: every row verified for a drafted step, else the
        next token (none before a replay's end: those tokens were sent already)."""
        if w.draft:
            return self.verify(r, logits, w, compute)
        if w.pos + w.rows < r.replay_end:
            return None
        tok = self.sample(r, logits, w.pos + w.rows, compute)
        return tok if isinstance(tok, Ended) else (tok, w.pos + w.rows)

    def _advance(self, r: Request, text: str) -> tuple[str, str]:
        """One more token, whose ``text`` the stream settled, through the thoughts'
        track: the thoughts and the answer text it settles. A grammar that waited for
        the end of the thoughts starts after it."""
        assert r.track is not None
        split = r.track.split(text)
        grammar = r.track.grammar_now()
        if grammar is not None:
            r.constraint = grammar
        return split

    def sample(
        self, r: Request, logits: np.ndarray, next_pos: int, compute: list[float]
    ) -> int | Ended:
        """Pick the next token of ``r`` and send its text: the token, or how the
        request ended here."""
        assert r.sampler is not None and r.text is not None  # last stage: init ran
        c = r.constraint
        forced = r.track.forced() if r.track is not None else None
        try:
            if forced is None:
                if c is not None:
                    logits = c.mask(logits)
                drawn = r.sampler.draw(logits, r.n_generated, r.sampling.logprobs)
            else:
                drawn = Draw(forced)  # put there, not drawn: the penalties count it too
                r.sampler.accept(forced)
            if c is not None and drawn.token not in self.eos:
                c.accept(drawn.token)
        except ValueError as e:  # a bias, penalty or grammar that leaves no token
            return Ended("cancel", error=("bad_sampling", str(e)))
        tok = drawn.token
        r.n_generated += 1
        finish = None
        text = thoughts = ""
        logprobs: list[wire.TokenLogprob] = []
        if tok in self.eos and (c is not None or not r.sampling.ignore_eos):
            finish = "stop"  # the end token is not part of the answer, nor its logprob
        else:
            if r.sampling.logprobs is not None:
                logprobs.append(self.token_logprob(drawn))
            text, stopped = r.text.push(tok)
            if r.track is not None:
                thoughts, text = self._advance(r, text)
            if stopped or (c is not None and c.done):
                finish = "stop"
            elif (
                r.sampling.max_tokens is not None and r.n_generated >= r.sampling.max_tokens
            ) or next_pos + 1 >= self.n_ctx:
                finish = "length"
        if finish is None:
            self.links.chunk(r.reply_to, wire.DataChunk(
                req=r.req, text=text, tokens=[tok], compute=compute, logprobs=logprobs,
                reasoning=thoughts,
            ))  # fmt: skip
            return tok
        # Whatever ended the stream, text held back for a possible stop string or an
        # unfinished character belongs to the output (an EOS right after "Hello." with
        # stop ".\n" must not eat the "."); after a stop string finish() adds nothing.
        rest = r.text.finish()
        if r.track is not None:
            more, rest = r.track.finish(rest)
            thoughts += more
        text += rest
        if r.text.matched is not None:
            finish = "stop"  # the held-back tail completed a stop string
        last = wire.DataChunk(
            req=r.req, text=text, tokens=[tok], finish_reason=finish, usage=r.usage(),
            logprobs=logprobs, stop_sequence=r.text.matched, reasoning=thoughts,
        )  # fmt: skip
        # Every position before this token holds the answer's KV; rows after it (the
        # rest of a draft, a chained step's) are not kept.
        return Ended("done", next_pos, chunk=last)

    def verify(self, r: Request, logits: np.ndarray, w: Work, compute: list[float]) -> Next:
        """A speculative step: draw from each row in turn, as one row a step would,
        while the draw equals the draft; the first other token (or the one after a
        whole accepted draft) is fed back. For a sampled request this is the standard
        rejection rule for a draft that is one token for sure: the draft is kept with
        the probability the model gives it, else the draw comes from the rest, so the
        output follows the same distribution as without a draft."""
        r.n_drafted += len(w.draft)
        by_model = w.draft_by == wire.DRAFT_BY_MODEL
        if by_model:
            r.n_model_drafted += len(w.draft)
        rows = w.rows
        for i in range(rows):
            # The step's compute goes with its first token only: the node adds up the
            # compute of the tokens a chunk carries.
            tok = self.sample(
                r, logits[i], w.pos + i + 1, compute if i == 0 else [0.0] * len(compute)
            )
            if isinstance(tok, Ended):
                return tok
            if i == len(w.draft) or tok != w.draft[i]:
                return tok, w.pos + i + 1
            r.n_accepted += 1
            r.n_model_accepted += by_model
        # A chained step held whole: its last token is the first of the step stage 0
        # sent after it, which goes on from here. Stage 0 is told, and sends another.
        r.n_chained += 1
        self.links.token(r.route[0], r.req, r.generation, w.draft[-1], w.pos + rows, r.epoch)
        return None

    @functools.cached_property
    def pooling(self) -> Pooling:
        """How this model pools an input's hidden states (read on first use)."""
        return pooling_of(self.model_path)

    def embed(self, batch: list[tuple[Request, Work]]) -> list[Ended]:
        """Pool the final hidden states of embeddings requests: how each ended (one
        at a time if their engine call fails, so only the request at fault fails)."""
        items = [StageInput(seq=r.seq, pos=0, tokens=w.tokens, hidden=w.hidden) for r, w in batch]
        t0 = time.perf_counter()
        try:
            rows = self.stage.embed(items)
        except Exception as e:
            if len(batch) > 1:
                return [ended for one in batch for ended in self.embed([one])]
            r = batch[0][0]
            log.warning("embedding of %s failed: %s", r.req, e, extra={"req": r.req})
            return [Ended("cancel", error=("bad_input", f"stage {self.links.stage}: {e}"))]
        spent = round(time.perf_counter() - t0, 6)
        ended = []
        for (r, w), x in zip(batch, rows, strict=True):
            vector = pool(x, self.pooling)
            chunk = wire.DataChunk(
                req=r.req, embedding=vector.astype("<f4").tobytes(), finish_reason="stop",
                usage=wire.Usage(r.n_prompt, 0), compute=[*w.compute, spent],
            )  # fmt: skip
            ended.append(Ended("done", chunk=chunk))
        return ended

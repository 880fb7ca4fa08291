"""Token log-probabilities from the pipeline, in OpenAI's two shapes.

The last stage reports, for each token of the answer, its log-probability and the most
likely tokens' (``wire.TokenLogprob``) under the distribution it was sampled from: the
logits after ``logit_bias`` and penalties, at the request's temperature (1 when greedy),
before the top-k, top-p and min-p cuts (``meshd.engines.sampling.log_probs``). The end
token that stops an answer is not part of it and has none. A token's text is its bytes
as UTF-8 (a byte that starts or ends a character split over tokens shows as U+FFFD;
``bytes`` has them exactly).
"""

from __future__ import annotations

from meshd.transport import wire

from .schemas import ChatTokenLogprob, ChatTopLogprob, ChoiceLogprobs, CompletionLogprobs

__all__ = ["chat_logprobs", "completion_logprobs"]


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(items: list[wire.TokenLogprob]) -> ChoiceLogprobs:
    """``choices[].logprobs`` of a chat answer (or of one streamed chunk)."""
    return ChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                token=_text(t.piece),
                logprob=t.logprob,
                bytes=list(t.piece),
                top_logprobs=[
                    ChatTopLogprob(token=_text(a.piece), logprob=a.logprob, bytes=list(a.piece))
                    for a in t.top
                ],
            )
            for t in items
        ]
    )


def completion_logprobs(
    items: list[wire.TokenLogprob], offset: int, n_top: int
) -> CompletionLogprobs:
    """``choices[].logprobs`` of a text completion; ``offset``: characters before the
    first token (the prompt's, then what earlier chunks of a stream held)."""
    tokens, offsets = [], []
    for t in items:
        text = _text(t.piece)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = None
    if n_top > 0:
        # Two alternatives with the same text (different ids) keep the likelier one.
        top = [{_text(a.piece): a.logprob for a in reversed(t.top)} for t in items]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[t.logprob for t in items],
        top_logprobs=top,
        text_offset=offsets,
    )

"""A prompt over the model's context: the 400 ``context_length_exceeded`` worded as
OpenAI words it, which clients that trim a long history match on.

OpenAI's chat wording, as its API says it: "This model's maximum context length is N
tokens. However, you requested M tokens (P in the messages, C in the completion).
Please reduce the length of the messages or completion." when the request set a
completion length, else "However, your messages resulted in P tokens. Please reduce
the length of the messages." Its ``param`` names the request's own field: ``prompt``
for ``/v1/completions``, ``input`` for Responses (and embeddings), ``messages`` for
chat. The message is the same in every dialect; each dialect's error keeps its own
shape (Anthropic's and Ollama's carry no ``param``).
"""

from __future__ import annotations

from meshd.crdt.views import Instance
from meshd.node.errors import RequestFailed
from meshd.placement.policy import instance_context

from .errors import ApiError, request_failed

__all__ = ["PROMPT_PARAM", "context_overflow", "refusal"]

#: The field that holds the prompt, by route (what ``param`` names); else ``messages``.
PROMPT_PARAM: dict[str, str] = {
    "completions": "prompt",
    "responses": "input",
    "embeddings": "input",
}


def context_overflow(
    n_prompt: int, n_ctx: int, *, n_completion: int | None = None, param: str = "messages"
) -> ApiError:
    """400 ``context_length_exceeded``: the prompt (plus ``n_completion``, the
    request's ``max_tokens`` when it set one) does not fit ``n_ctx`` tokens."""
    if n_completion is None:
        detail = f"However, your messages resulted in {n_prompt} tokens."
        fix = "Please reduce the length of the messages."
    else:
        detail = (
            f"However, you requested {n_prompt + n_completion} tokens "
            f"({n_prompt} in the messages, {n_completion} in the completion)."
        )
        fix = "Please reduce the length of the messages or completion."
    return ApiError(
        400,
        f"This model's maximum context length is {n_ctx} tokens. {detail} {fix}",
        type="invalid_request_error",
        param=param,
        code="context_length_exceeded",
    )


def refusal(e: RequestFailed, inst: Instance, route: str, max_tokens: int | None) -> ApiError:
    """The answer to stage 0's refusal of a request on ``inst`` through ``route``:
    a prompt over the context in OpenAI's words (``max_tokens``: the request's own, None
    when it set none), anything else as :func:`request_failed` says."""
    if e.code != "context_length_exceeded" or not e.n_prompt:
        return request_failed(e)
    param = PROMPT_PARAM.get(route, "messages")
    n_ctx = instance_context(inst)
    return context_overflow(e.n_prompt, n_ctx, n_completion=max_tokens, param=param)

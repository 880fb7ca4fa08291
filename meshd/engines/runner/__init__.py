"""A runner: one pipeline stage of one model instance, in its own process.

Data plane (all messages carry the request id and the plan generation):

* stage 0 gets ``Generate``: renders the chat template, tokenizes, checks the context,
  sends the API node a ``DataChunk(n_prompt=...)``, then runs its layers on the prompt
  in chunks, each sent on as soon as it is computed;
* a middle stage gets ``Activation`` (hidden rows in a raw float32 frame) and passes
  its own on;
* the last stage samples, sends text to the API node (``DataChunk``) and the token back
  to stage 0 (``Token``), until the request finishes; then ``Release`` walks the chain.

KV slots are never held forever: a new plan generation frees the requests of older
ones, a request idle for ``request_expiry_s`` is freed (its stage 0 died, so no cancel
can reach this stage), and a cancel for a request this stage does not know is accepted.
Requests in flight are batched: one engine call per step serves every request that
has work; stage 0 of a split steps them in micro-batches, one per stage, so the stages
work at once (see :func:`.step.group_size`).

One module a job:

=================  ================================================================
``process``        the process: config, sockets, loading the stage (``main``)
``loop``           the message loop: frames, stdin commands, the clock
``core``           what the stage does with each message, step and tick
``links``          everything sent: messages, coalesced output, supervisor lines
``state``          a request's state, a unit of work, the counters
``requests``       the requests held, and how a hold ends (release, keep, free)
``admission``      stage 0's admission (prompt, tools, context) and a later stage's
``seats``          KV sequences and the prefix cache
``prefills``       prompt steps shared by the choices of one prompt
``chunks``         stage 0's prompt cut into chunks, each sent on when computed
``step``           the batched engine call
``speculation``    stage 0's drafted and chained steps
``output``         the last stage: sampling, verification, text, embeddings
=================  ================================================================
"""

from .loop import Runner
from .process import check_model, load_stage, main
from .seats import common_prefix
from .stdin import StdinLines

__all__ = ["Runner", "StdinLines", "check_model", "common_prefix", "load_stage", "main"]

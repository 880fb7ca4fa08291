"""The exact mode: one switch for everything that may move the low bits of an answer.

By default a request takes every fast path: it starts from a kept prefix of an earlier
request whose tokens begin the same way, and drafts tokens for the pipeline to verify in
one pass where that pays. Each sums the model's rows in another order than a cold run
of one row a step does, so a near-tie between two tokens may flip (a quantized model's
logits move by up to ~0.5). The exact mode takes none of them: the same request on the
same plan gives the same tokens, bit for bit, whatever ran before. A request asks with
``exact`` (every dialect's body), an instance with ``InstanceSpec.exact`` (its requests
that do not say); the tests that compare greedy tokens with a reference use it.

A fast path that may move low bits asks :func:`fast_paths` whether a request may take
it, and this module is the one place that says what exact turns off.
"""

from __future__ import annotations

import msgspec

from .job import Job

__all__ = ["EXACT", "FastPaths", "fast_paths", "settled"]


class FastPaths(msgspec.Struct, frozen=True, kw_only=True):
    """The fast paths a request may take that move the low bits of its logits. Each
    still follows the request's own setting and the engine's defaults where allowed
    (``Job.cache_prompt``, ``Job.speculate``)."""

    #: Start from the KV of an earlier request with the same beginning: those rows
    #: were summed in other batches than this prompt's.
    prefix_reuse: bool = True
    #: Draft tokens for the pipeline to verify in one pass: a batch of rows sums in
    #: another order than one row a step.
    speculation: bool = True
    #: Send hidden rows between stages in the instance's narrow type (f16 by default,
    #: ``InstanceSpec.activations``): half the bytes of float32, and a stage's rows
    #: rounded to 11 significant bits move the next stage's logits (on a quantized
    #: model about as far as its own quantization does: docs/operations.md).
    narrow_hops: bool = True


#: What the exact mode allows: none of them.
EXACT = FastPaths(prefix_reuse=False, speculation=False, narrow_hops=False)


def fast_paths(job: Job) -> FastPaths:
    """What ``job`` may do that moves low bits: nothing in the exact mode (``job.exact``,
    :func:`settled` with its instance's setting), every fast path otherwise."""
    return EXACT if job.exact else FastPaths()


def settled(job: Job, instance_exact: bool) -> Job:
    """``job`` with ``exact`` decided: its own setting, else its instance's
    (``InstanceSpec.exact``). The API node settles it before it sends the job, so the
    runners read one bool and never need the instance's spec."""
    if job.exact is not None:
        return job
    return msgspec.structs.replace(job, exact=instance_exact)

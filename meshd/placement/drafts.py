"""Which placed model drafts for another (speculative decoding): a pure choice.

A draft model proposes the next few tokens of a request; the target verifies them all
in one pass through its pipeline (see ``meshd.engines.draft_model``). It pays only when
its proposals cost far less than a pass of the target and mean the same tokens, so a
candidate must:

* be another instance, ready, on one node (its runner computes whole proposals);
* generate (not an embedding model) and share the target's token list exactly
  (``ModelFacts.vocab_hash``: the same id is the same text);
* weigh at most :data:`MAX_SHARE` of the target's bytes (a decode step reads every
  weight once, so bytes set a step's cost), unless the user named it;
* be the model ``InstanceSpec.draft`` names, when it names one (``none``: no draft).

Among them the nearest to the target's stage 0 wins: on its very node (no link to
cross), else the least round trip from there, then the fewest bytes, then the id, so
every node that asks gets the same answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from meshd.crdt.views import Instance
from meshd.domain.facts import ModelFacts

__all__ = ["MAX_SHARE", "NO_DRAFT", "can_draft", "model_bytes", "pick_draft"]

#: Largest draft model, as a share of the target's bytes.
MAX_SHARE = 0.5
#: ``InstanceSpec.draft`` saying: never draft with a model.
NO_DRAFT = "none"


def model_bytes(f: ModelFacts) -> int:
    """Bytes of a model's weights (what one decode step reads)."""
    return sum(f.layer_bytes) + f.embed_bytes + f.head_bytes


def can_draft(draft: ModelFacts, target: ModelFacts, named: bool = False) -> bool:
    """Whether ``draft``'s proposals mean tokens to ``target`` and cost far less (or
    the user ``named`` it: then its size is their call)."""
    return (
        bool(target.vocab_hash)
        and draft.vocab_hash == target.vocab_hash
        and not draft.embedding_only
        and not target.embedding_only
        and (named or model_bytes(draft) <= MAX_SHARE * model_bytes(target))
    )


def pick_draft(
    target: Instance,
    ready: Iterable[Instance],
    rtt_ms: Mapping[str, float],
    same_model: Callable[[str, str], bool] = lambda a, b: a == b,
) -> Instance | None:
    """The instance that drafts for ``target`` among the ``ready`` ones (see the
    module doc); ``rtt_ms``: round trips from the node of ``target``'s stage 0, by
    node id. ``same_model(name, wanted)`` says whether a model name is the one
    ``InstanceSpec.draft`` asks for (aliases resolve there)."""
    tf = target.facts
    wanted = target.spec.draft
    if tf is None or not target.stages or wanted == NO_DRAFT:
        return None
    home = target.stages[0].node
    best: tuple[tuple[int, float, int, str], Instance] | None = None
    for c in ready:
        f = c.facts
        if c.id == target.id or len(c.stages) != 1 or f is None:
            continue
        if wanted and not same_model(c.spec.model, wanted):
            continue
        if not can_draft(f, tf, named=bool(wanted)):
            continue
        node = c.stages[0].node
        near = 0 if node == home else 1
        key = (near, rtt_ms.get(node, float("inf")) if near else 0.0, model_bytes(f), c.id)
        if best is None or key < best[0]:
            best = (key, c)
    return best[1] if best else None

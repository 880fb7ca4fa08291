"""Which placed model drafts for another: same tokens, far fewer bytes, nearest first."""

from __future__ import annotations

from meshd.crdt.views import Instance, InstanceSpec, Stage
from meshd.domain.facts import ModelFacts
from meshd.placement.drafts import MAX_SHARE, can_draft, model_bytes, pick_draft

VOCAB = "88b27e9cee03205b2fe70c62915d2bf1"


def facts(name: str, layer_mb: int, vocab: str = VOCAB, **kw: object) -> ModelFacts:
    return ModelFacts(
        name=name, sha256=name * 4, n_layers=4, hidden_size=64, n_ctx_train=4096,
        layer_bytes=[layer_mb << 20] * 4, embed_bytes=1 << 20, vocab_hash=vocab, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def inst(iid: str, f: ModelFacts, *nodes: str, draft: str = "") -> Instance:
    stages = [Stage(node=n, start=i, end=i + 1, engine="llama_cpp") for i, n in enumerate(nodes)]
    return Instance(id=iid, spec=InstanceSpec(model=f.name, draft=draft), stages=stages, facts=f)


BIG = facts("big", 100)
TARGET = inst("t", BIG, "a", "b")


def test_a_draft_shares_the_tokens_and_weighs_at_most_half() -> None:
    assert can_draft(facts("small", 10), BIG)
    assert not can_draft(facts("other-vocab", 10, vocab="ff" * 16), BIG)
    assert not can_draft(facts("heavy", 60), BIG)  # more than MAX_SHARE of the bytes
    assert model_bytes(facts("half", 49)) <= MAX_SHARE * model_bytes(BIG)
    assert not can_draft(facts("unknown", 10, vocab=""), facts("t", 100, vocab=""))
    assert not can_draft(facts("encoder", 10, embedding_only=True), BIG)


def test_the_nearest_draft_wins_then_the_lightest() -> None:
    here = inst("d-here", facts("small", 20), "a")
    near = inst("d-near", facts("small", 10), "c")
    far = inst("d-far", facts("tiny", 5), "d")
    rtt = {"c": 0.5, "d": 4.0}
    assert pick_draft(TARGET, [far, near, here], rtt) is here  # on stage 0's own node
    assert pick_draft(TARGET, [far, near], rtt) is near  # then the least round trip
    assert pick_draft(TARGET, [far, near], {}) is far  # unknown trips: the lightest
    # Not a draft: the target itself, a split one, another vocabulary, too heavy.
    split = inst("d-split", facts("small", 10), "a", "c")
    heavy = inst("d-heavy", facts("heavy", 80), "a")
    alien = inst("d-alien", facts("alien", 5, vocab="ee" * 16), "a")
    assert pick_draft(TARGET, [TARGET, split, heavy, alien], rtt) is None


def test_the_spec_names_the_draft_or_none() -> None:
    a = inst("d-a", facts("small-a", 10), "a")
    b = inst("d-b", facts("small-b", 10), "c")
    named = inst("t", BIG, "a", "b", draft="small-b")
    assert pick_draft(named, [a, b], {}) is b
    off = inst("t", BIG, "a", "b", draft="none")
    assert pick_draft(off, [a, b], {}) is None
    # Named, its size is the user's call (never its tokens).
    heavy = inst("d-heavy", facts("heavy", 80), "a")
    assert pick_draft(inst("t", BIG, "a", "b", draft="heavy"), [heavy], {}) is heavy
    assert pick_draft(TARGET, [heavy], {}) is None
    alien = inst("d-alien", facts("alien", 5, vocab="ee" * 16), "a")
    assert pick_draft(inst("t", BIG, "a", "b", draft="alien"), [alien], {}) is None

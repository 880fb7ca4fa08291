"""A fetch believes no single holder: real holders (``WeightServer``) and a real fetcher
(``fetch_slice``) on loopback sockets in one process, one holder lying.

A liar serves other bytes under a manifest of its own that is self-consistent: every
chunk matches the digest it offered, so only the vote on the root and the check before
loading can catch it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import zmq.asyncio

from meshd.domain.facts import ModelFacts
from meshd.models.facts import read_facts
from meshd.models.manifest import SLICE_FORMAT_VERSION, Manifest, build_manifest, slice_id
from meshd.models.slice_check import SliceMismatch, check_slice
from meshd.models.slicing import slice_gguf
from meshd.transport import wire
from meshd.transport.stats import DropCounters
from meshd.transport.transfer import (
    FetchError,
    FetchProgress,
    SliceRejected,
    WeightServer,
    fetch_slice,
)
from tests.transport.test_transfer import ASK, CHUNK, SHA, blob, holder_addr, run, sha

pytestmark = pytest.mark.timeout(60)

__all__ = ["blob"]  # the fixture, shared with test_transfer


def lying(path: Path, tmp: Path) -> Path:
    """``path`` with one byte changed: what a liar serves as the same slice."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    out = tmp / "liar" / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(bytes(data))
    return out


def server(
    ctx: zmq.asyncio.Context, path: Path, gate: threading.Event | None = None
) -> WeightServer:
    """A holder serving ``path`` for any ask of the model (``gate``: it offers only once
    set, as a holder still cutting the slice)."""

    def prepare(ask: wire.SliceAsk) -> tuple[Path, Manifest]:
        if gate is not None:
            gate.wait(30)
        return path, build_manifest(path, slice_id(ask.sha256, ask.start, ask.end), CHUNK)

    s = WeightServer(ctx, prepare=prepare, bind_host="127.0.0.1")
    s.start()
    return s


def test_a_liar_that_offers_first_is_outvoted_and_the_honest_holders_serve(
    blob: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "meshd.transfer")
    ask = wire.SliceAsk(model="m", sha256=SHA, start=2, end=5, version=SLICE_FORMAT_VERSION)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        gate = threading.Event()
        liar = server(ctx, lying(blob, tmp_path))
        a, b = server(ctx, blob, gate), server(ctx, blob, gate)
        counters = DropCounters()
        last = FetchProgress()
        send = liar._send

        async def offered(peer: bytes, msg: wire.TransferMessage, *raw: bytes) -> None:
            await send(peer, msg, *raw)
            gate.set()  # the liar's offer is on its way: the honest holders' follow

        liar._send = offered  # type: ignore[method-assign]

        def note(p: FetchProgress) -> None:
            nonlocal last
            last = FetchProgress(**vars(p))

        holders = [holder_addr("liar", liar), holder_addr("a", a), holder_addr("b", b)]
        try:
            dest = tmp_path / "f" / "s.gguf"
            m = await fetch_slice(
                ctx, holders=lambda: holders, ask=ask, dest=dest, own_addresses=["127.0.0.1"],
                on_progress=note, counters=counters, window=4,
            )  # fmt: skip
            assert sha(dest) == sha(blob)
            assert m.root == build_manifest(blob, m.slice, CHUNK).root
            # Neither honest holder was shunned for disagreeing with the first offer.
            assert a.sent > 0 and b.sent > 0
            assert last.dissent == 1 and counters.get("weights", "other_root") == 1
            assert "liar offers other bytes" in caplog.text
        finally:
            gate.set()
            for s in (liar, a, b):
                await s.stop()
            ctx.term()

    run(main())


def test_a_liar_taken_alone_is_dropped_for_the_root_the_later_holders_agree_on(
    blob: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The honest holders are still cutting when the wait runs out: the liar's root is
    taken and pulled. Then they offer: 1:1 with one still to answer holds the liar's
    root without a lead; 2:1 switches the fetch to theirs, which starts over."""
    caplog.set_level(logging.WARNING, "meshd.transfer")

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        gate = threading.Event()
        liar = server(ctx, lying(blob, tmp_path))
        a, b = server(ctx, blob, gate), server(ctx, blob, gate)
        real, served = liar._chunk, 0

        async def then_hang(peer: bytes, ask: wire.ChunkAsk) -> None:
            nonlocal served
            served += 1
            if served <= 4:  # a few chunks, then nothing: only the switch ends the fetch
                await real(peer, ask)

        liar._chunk = then_hang  # type: ignore[method-assign]
        last = FetchProgress()

        def note(p: FetchProgress) -> None:
            nonlocal last
            last = FetchProgress(**vars(p))
            gate.set()  # the liar's root is taken: the honest holders now offer

        holders = [holder_addr("liar", liar), holder_addr("a", a), holder_addr("b", b)]
        try:
            dest = tmp_path / "f" / "s.gguf"
            await fetch_slice(
                ctx, holders=lambda: holders, ask=ASK, dest=dest, own_addresses=["127.0.0.1"],
                on_progress=note, offer_wait=0.1, window=2,
            )  # fmt: skip
            assert sha(dest) == sha(blob)
            assert liar.sent <= 4 * CHUNK and a.sent + b.sent == blob.stat().st_size
            # The switch is what must happen; the liar's dissent is counted only if its
            # puller sees the new root before the fetch ends (a diagnostic, not a race
            # worth a flaky test).
            assert "the fetch starts over" in caplog.text and last.dissent <= 1
        finally:
            gate.set()
            for s in (liar, a, b):
                await s.stop()
            ctx.term()

    run(main())


def test_two_holders_that_disagree_fail_the_fetch_typed_and_nothing_is_kept(
    blob: Path, tmp_path: Path
) -> None:
    ask = wire.SliceAsk(model="m", sha256=SHA, start=2, end=5, version=SLICE_FORMAT_VERSION)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        liar, a = server(ctx, lying(blob, tmp_path)), server(ctx, blob)
        try:
            dest = tmp_path / "f" / "s.gguf"
            with pytest.raises(FetchError) as e:
                await fetch_slice(
                    ctx, holders=lambda: [holder_addr("liar", liar), holder_addr("a", a)],
                    ask=ask, dest=dest, own_addresses=["127.0.0.1"],
                )  # fmt: skip
            assert e.value.code == "disagree"
            assert "a offers root" in str(e.value) and "liar offers root" in str(e.value)
            assert not dest.exists()
        finally:
            for s in (liar, a):
                await s.stop()
            ctx.term()

    run(main())


def tiny_model(path: Path, tokens: tuple[str, ...] = ("a", "b", "c")) -> Path:
    """A 4-layer GGUF of a few hundred KiB (each layer one 128 KiB tensor)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(4)
    w.add_embedding_length(8)
    w.add_context_length(64)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(list(tokens))
    w.add_tensor("token_embd.weight", np.ones((len(tokens), 8), np.float32))
    for i in range(4):
        w.add_tensor(f"blk.{i}.ffn_up.weight", np.full((4096, 8), i, np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, ModelFacts]:
    path = tiny_model(tmp_path / "model.gguf")
    return path, read_facts(path, "tiny")


def test_a_poisoned_slice_is_never_loaded_and_the_fetch_goes_on_from_an_honest_holder(
    model: tuple[Path, ModelFacts], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The liar answers alone (the honest holder is still cutting), so its root is
    taken; its slice, the same layers under a tokenizer with a role token forged in,
    fails the check against the model's facts: it is deleted, the liar loses its vote,
    the honest holder's slice is fetched."""
    caplog.set_level(logging.WARNING, "meshd.transfer")
    path, facts = model
    start, end = 1, 3
    honest = slice_gguf(path, start, end, tmp_path / "honest", facts.sha256)
    forged = tiny_model(tmp_path / "forged.gguf", tokens=("a", "<|im_start|>", "c"))
    poisoned = slice_gguf(forged, start, end, tmp_path / "liar", facts.sha256)
    assert poisoned.stat().st_size == honest.stat().st_size
    ask = wire.SliceAsk(
        model="tiny", sha256=facts.sha256, start=start, end=end, version=SLICE_FORMAT_VERSION
    )
    seen: list[str] = []
    gate = threading.Event()

    def verify(p: Path, m: Manifest) -> None:
        seen.append(m.root)
        try:
            check_slice(p, facts, start, end)
        except SliceMismatch as e:
            raise SliceRejected(str(e)) from None
        finally:
            gate.set()  # the honest holder has finished cutting

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        liar, good = server(ctx, poisoned), server(ctx, honest, gate)
        counters = DropCounters()
        last = FetchProgress()

        def note(p: FetchProgress) -> None:
            nonlocal last
            last = FetchProgress(**vars(p))

        try:
            dest = tmp_path / "f" / f"{start}-{end}.gguf"
            m = await fetch_slice(
                ctx, holders=lambda: [holder_addr("liar", liar), holder_addr("good", good)],
                ask=ask, dest=dest, own_addresses=["127.0.0.1"], on_progress=note,
                offer_wait=0.2, verify=verify, counters=counters,
            )  # fmt: skip
            assert sha(dest) == sha(honest)
            check_slice(dest, facts, start, end)
            assert seen == [build_manifest(poisoned, m.slice, CHUNK).root, m.root]
            assert m.root == build_manifest(honest, m.slice, CHUNK).root
            assert last.rejected == 1 and counters.get("weights", "rejected") == 1
            assert liar.sent == poisoned.stat().st_size and good.sent == honest.stat().st_size
            assert "(vocab_hash differ)" in caplog.text and "offered by liar" in caplog.text
            assert not list(dest.parent.glob("*.part*"))
        finally:
            gate.set()
            for s in (liar, good):
                await s.stop()
            ctx.term()

    run(main())


def test_the_check_before_loading_holds_a_slice_to_the_models_facts(
    model: tuple[Path, ModelFacts], tmp_path: Path
) -> None:
    path, facts = model
    ok = slice_gguf(path, 1, 3, tmp_path, facts.sha256)
    check_slice(ok, facts, 1, 3)
    with pytest.raises(SliceMismatch, match="n_layers, layer_bytes differ"):
        check_slice(ok, facts, 1, 4)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(SliceMismatch, match="not a GGUF slice"):
        check_slice(junk, facts, 1, 3)
    # The whole range is the file itself: one changed byte is caught by its sha256.
    assert slice_gguf(path, 0, 4, tmp_path, facts.sha256) == path
    check_slice(path, facts, 0, 4)
    with pytest.raises(SliceMismatch, match="the whole model's sha256"):
        check_slice(lying(path, tmp_path), facts, 0, 4)

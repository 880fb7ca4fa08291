"""Slice transfer over real ZeroMQ sockets in one process: holders (``WeightServer``)
and a fetcher (``fetch_slice``), on loopback, with files on disk.

Small chunks (64 KiB) make a 2 MiB file 32 chunks, so windows, several holders,
corruption, a holder lost mid-transfer and resuming all happen within a second.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from meshd.models.manifest import SLICE_FORMAT_VERSION, Manifest, build_manifest, slice_id
from meshd.transport import wire
from meshd.transport.security import CurveKeys, start_zap
from meshd.transport.transfer import (
    CORRUPT_ENV,
    FetchError,
    FetchProgress,
    SliceUnavailable,
    WeightServer,
    fetch_slice,
)

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 * 1024
SHA = "ab" * 32
ASK = wire.SliceAsk(model="m", sha256=SHA, start=2, end=5, version=SLICE_FORMAT_VERSION)


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    p = tmp_path / "holder" / "slice.gguf"
    p.parent.mkdir()
    p.write_bytes(os.urandom(32 * CHUNK - 1234))  # the last chunk is short
    return p


def preparer(path: Path, delay: float = 0.0):
    def prepare(ask: wire.SliceAsk) -> tuple[Path, Manifest]:
        if ask.sha256 != SHA:
            raise SliceUnavailable("not_held", "another file")
        return path, build_manifest(path, slice_id(ask.sha256, ask.start, ask.end), CHUNK)

    return prepare


def holder_addr(name: str, server: WeightServer) -> wire.Addr:
    return wire.Addr(node=name, addresses=["127.0.0.1"], port=server.port)


async def serve(ctx: zmq.asyncio.Context, path: Path, **kw) -> WeightServer:
    s = WeightServer(ctx, prepare=preparer(path), bind_host="127.0.0.1", **kw)
    s.start()
    return s


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 45))


def test_two_holders_share_the_chunks_and_every_byte_arrives(blob: Path, tmp_path: Path) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        a, b = await serve(ctx, blob), await serve(ctx, blob)
        seen: list[FetchProgress] = []
        try:
            dest = tmp_path / "fetcher" / "2-5.gguf"
            m = await fetch_slice(
                ctx, holders=lambda: [holder_addr("a", a), holder_addr("b", b)], ask=ASK,
                dest=dest, own_addresses=["127.0.0.1"], window=4,
                on_progress=lambda p: seen.append(FetchProgress(**vars(p))),
            )  # fmt: skip
            assert sha(dest) == sha(blob)
            assert m.root == build_manifest(blob, m.slice, CHUNK).root
            assert m.slice == slice_id(SHA, 2, 5)
            # Both holders served a share; nothing was sent twice.
            assert a.sent > 0 and b.sent > 0 and a.sent + b.sent == blob.stat().st_size
            assert seen[-1].done == seen[-1].total == blob.stat().st_size
            assert not dest.with_name(dest.name + ".part").exists()
            assert dest.with_name(dest.name + ".manifest").exists()
        finally:
            await a.stop()
            await b.stop()
            ctx.term()

    run(main())


def test_a_corrupted_chunk_is_dropped_counted_and_fetched_again(
    blob: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        monkeypatch.setenv(CORRUPT_ENV, "2")
        bad = await serve(ctx, blob)
        monkeypatch.delenv(CORRUPT_ENV)
        last = FetchProgress()
        try:
            dest = tmp_path / "f" / "s.gguf"

            def note(p: FetchProgress) -> None:
                nonlocal last
                last = FetchProgress(**vars(p))

            await fetch_slice(
                ctx, holders=lambda: [holder_addr("bad", bad)], ask=ASK, dest=dest,
                own_addresses=["127.0.0.1"], on_progress=note,
            )  # fmt: skip
            assert sha(dest) == sha(blob)
            assert last.corrupt == 2
        finally:
            await bad.stop()
            ctx.term()

    run(main())


def test_a_holder_lost_mid_transfer_leaves_its_chunks_to_the_other(
    blob: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        a, b = await serve(ctx, blob), await serve(ctx, blob)
        # b answers slowly, so a is stopped while b still holds chunks in flight.
        real = b._chunk

        async def slow(peer: bytes, ask: wire.ChunkAsk) -> None:
            await asyncio.sleep(0.05)
            await real(peer, ask)

        b._chunk = slow  # type: ignore[method-assign]
        holders = {"a": holder_addr("a", a), "b": holder_addr("b", b)}
        dest = tmp_path / "f" / "s.gguf"

        async def kill_a() -> None:
            while a.sent < 4 * CHUNK:
                await asyncio.sleep(0.005)
            await a.stop()
            del holders["a"]  # as the cluster view drops a dead node

        try:
            killer = asyncio.create_task(kill_a())
            await fetch_slice(
                ctx, holders=lambda: list(holders.values()), ask=ASK, dest=dest,
                own_addresses=["127.0.0.1"], window=2, chunk_timeout=1.0,
            )  # fmt: skip
            await killer
            assert sha(dest) == sha(blob)
            assert a.sent < blob.stat().st_size
        finally:
            await b.stop()
            ctx.term()

    run(main())


def test_a_fetch_cut_short_resumes_from_its_verified_chunks(blob: Path, tmp_path: Path) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        a = await serve(ctx, blob)
        dest = tmp_path / "f" / "s.gguf"
        try:
            # First attempt: the only holder leaves after a few chunks.
            holders = [holder_addr("a", a)]
            real = a._chunk
            served = 0

            async def limited(peer: bytes, ask: wire.ChunkAsk) -> None:
                nonlocal served
                served += 1
                if served <= 10:
                    await real(peer, ask)

            a._chunk = limited  # type: ignore[method-assign]
            with pytest.raises(FetchError) as e:
                await fetch_slice(
                    ctx, holders=lambda: holders, ask=ASK, dest=dest,
                    own_addresses=["127.0.0.1"], window=1, chunk_timeout=0.5,
                    stall_timeout=1.5,
                )  # fmt: skip
            assert e.value.code == "stalled"
            assert "10/32 chunks verified" in str(e.value)
            assert not dest.exists()
            # Second attempt: only what is missing travels.
            a._chunk = real  # type: ignore[method-assign]
            before = a.sent
            last = FetchProgress()

            def note(p: FetchProgress) -> None:
                nonlocal last
                last = FetchProgress(**vars(p))

            await fetch_slice(
                ctx, holders=lambda: holders, ask=ASK, dest=dest,
                own_addresses=["127.0.0.1"], on_progress=note,
            )  # fmt: skip
            assert sha(dest) == sha(blob)
            assert last.resumed == 10 * CHUNK
            assert a.sent - before == blob.stat().st_size - 10 * CHUNK
        finally:
            await a.stop()
            ctx.term()

    run(main())


def test_a_holder_that_refuses_ends_the_fetch_typed(blob: Path, tmp_path: Path) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        a = await serve(ctx, blob)
        try:
            other = wire.SliceAsk(
                model="m", sha256="cd" * 32, start=0, end=1, version=SLICE_FORMAT_VERSION
            )
            with pytest.raises(FetchError) as e:
                await fetch_slice(
                    ctx, holders=lambda: [holder_addr("a", a)], ask=other,
                    dest=tmp_path / "x.gguf", own_addresses=["127.0.0.1"],
                    chunk_timeout=0.5, no_holder_grace=0.5,
                )  # fmt: skip
            assert e.value.code == "no_holder" and "a: another file" in str(e.value)
            future = wire.SliceAsk(model="m", sha256=SHA, start=0, end=1, version=99)
            with pytest.raises(FetchError) as e:
                await fetch_slice(
                    ctx, holders=lambda: [holder_addr("a", a)], ask=future,
                    dest=tmp_path / "y.gguf", own_addresses=["127.0.0.1"],
                )  # fmt: skip
            assert e.value.code == "refused" and "slicing format 99" in str(e.value)
        finally:
            await a.stop()
            ctx.term()

    run(main())


def test_malformed_frames_are_dropped_and_counted_and_the_holder_still_serves(
    blob: Path,
) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        a = await serve(ctx, blob)
        d = ctx.socket(zmq.DEALER)
        d.connect(f"tcp://127.0.0.1:{a.port}")
        try:
            await d.send_multipart([b"\xc1garbage"])
            await d.send_multipart([b"a", b"b", b"c"])
            await d.send_multipart([wire.encode(wire.ChunkAsk(slice="nope", index=0))])
            frames = await asyncio.wait_for(d.recv_multipart(), 5)
            refusal = wire.decode_transfer(frames[0])
            assert isinstance(refusal, wire.SliceRefusal) and refusal.code == "unknown_slice"
            await d.send_multipart([wire.encode(ASK)])
            frames = await asyncio.wait_for(d.recv_multipart(), 5)
            assert isinstance(wire.decode_transfer(frames[0]), wire.SliceOffer)
            assert a.counters.get("weights", "malformed") >= 1
            assert a.counters.get("weights", "shape") >= 1
        finally:
            d.close(linger=0)
            await a.stop()
            ctx.term()

    run(main())


def test_in_a_secured_cluster_a_stranger_gets_nothing(blob: Path) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        keys = CurveKeys.generate()
        denied: list[int] = []
        zap = start_zap(ctx, lambda key: key == keys.public, lambda: denied.append(1))
        a = await serve(ctx, blob, keys=keys)
        stranger_pub, stranger_sec = zmq.curve_keypair()
        plain = ctx.socket(zmq.DEALER)
        curved = ctx.socket(zmq.DEALER)
        curved.curve_serverkey = keys.public  # even knowing the server's key
        curved.curve_publickey, curved.curve_secretkey = stranger_pub, stranger_sec
        member = ctx.socket(zmq.DEALER)
        member.curve_serverkey = keys.public
        member.curve_publickey, member.curve_secretkey = keys.public, keys.secret
        socks = [plain, curved, member]
        try:
            for s in socks:
                s.connect(f"tcp://127.0.0.1:{a.port}")
                await s.send_multipart([wire.encode(ASK)])
            got = await asyncio.wait_for(member.recv_multipart(), 5)
            assert isinstance(wire.decode_transfer(got[0]), wire.SliceOffer)
            for s in (plain, curved):
                assert await s.poll(1500) == 0
            assert denied
        finally:
            for s in socks:
                s.close(linger=0)
            await a.stop()
            zap.stop()
            ctx.term()

    run(main())


def test_a_slice_larger_than_the_free_disk_fails_at_once_typed(
    blob: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage

    def full(path):  # type: ignore[no-untyped-def]
        u = real(path)
        return usage(u.total, u.used, 1000)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        a = await serve(ctx, blob)
        try:
            monkeypatch.setattr(shutil, "disk_usage", full)
            with pytest.raises(FetchError) as e:
                await fetch_slice(
                    ctx, holders=lambda: [holder_addr("a", a)], ask=ASK,
                    dest=tmp_path / "f" / "s.gguf", own_addresses=["127.0.0.1"],
                )  # fmt: skip
            assert e.value.code == "disk" and "the disk has 0 MB" in str(e.value)
            assert a.sent == 0
        finally:
            await a.stop()
            ctx.term()

    run(main())

"""What meshd's slice transfer costs against a plain ZeroMQ copy, on loopback.

    python bench/transfer.py                      # 256 MiB, 1 warm-up + 3 repeats (~15 s)
    python bench/transfer.py --size-mb 64 --repeat 1

In one process and one event loop, on a temporary file of random bytes:

* **baseline**: a plain ZeroMQ copy: a ROUTER answers DEALER requests for 4 MiB chunks
  read with ``pread``, :data:`~meshd.transport.transfer.WINDOW` requests in flight, and
  the receiver writes each chunk with ``pwrite``; no hashing, no protocol. File I/O
  runs in threads (``asyncio.to_thread``), as in the real code.
* **meshd, 1 holder**: ``WeightServer`` + ``fetch_slice``, no CURVE: the chunk protocol,
  the sha256 of every chunk checked before it is written, the holder's read pool.
* **meshd, 2 holders**: the same, with two ``WeightServer`` over the same file.
* **meshd, CURVE**: one holder, both sockets CURVE-secured, ZAP admitting the member.

The holder's manifest is hashed once, before any timing (a holder caches it), so the
figures are the transfer alone. After ``--warmup`` untimed rounds the cases run
interleaved, repeat after repeat, so drift hits all alike; the table shows the median
MB/s of the repeats, their spread, and the ratio of medians to the baseline. Every
copy's sha256 is checked against the source's (a mismatch stops the run). A
benchmark: it prints figures and exits 0 whatever they are (goal: >= 0.8 for meshd,
1 holder, against the baseline). Temp files go under ``--dir`` and are removed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import zmq
import zmq.asyncio
from _common import log, med, spread, table

from meshd.models.manifest import (
    CHUNK_BYTES,
    SLICE_FORMAT_VERSION,
    Manifest,
    build_manifest,
    slice_id,
)
from meshd.transport import wire
from meshd.transport.security import CurveKeys, start_zap
from meshd.transport.transfer import WINDOW, WeightServer, fetch_slice

SHA = "ab" * 32
ASK = wire.SliceAsk(model="bench", sha256=SHA, start=0, end=1, version=SLICE_FORMAT_VERSION)
GOAL = 0.8
Case = Callable[[Path, Path], Awaitable[None]]


def write_source(path: Path, size: int) -> str:
    """Fill ``path`` with ``size`` random bytes; their sha256."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for off in range(0, size, CHUNK_BYTES):
            block = os.urandom(min(CHUNK_BYTES, size - off))
            h.update(block)
            f.write(block)
    return h.hexdigest()


def sha_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            h.update(block)
    return h.hexdigest()


# -- baseline: a plain ZeroMQ copy -------------------------------------------------------


async def _plain_serve(sock: zmq.asyncio.Socket, fd: int) -> None:
    async def answer(peer: bytes, req: bytes) -> None:
        (off,) = struct.unpack("!Q", req)
        data = await asyncio.to_thread(os.pread, fd, CHUNK_BYTES, off)
        await sock.send_multipart([peer, req, data])

    tasks: set[asyncio.Task[None]] = set()
    while True:
        peer, req = await sock.recv_multipart()
        t = asyncio.create_task(answer(peer, req))
        tasks.add(t)
        t.add_done_callback(tasks.discard)


async def plain_copy(src: Path, dest: Path) -> None:
    size = src.stat().st_size
    ctx = zmq.asyncio.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    rfd = os.open(src, os.O_RDONLY)
    wfd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    server = None
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        server = asyncio.create_task(_plain_serve(router, rfd))
        dealer.connect(f"tcp://127.0.0.1:{port}")
        todo = iter(range(0, size, CHUNK_BYTES))
        inflight = 0

        async def ask() -> None:
            nonlocal inflight
            if (off := next(todo, None)) is not None:
                await dealer.send(struct.pack("!Q", off))
                inflight += 1

        for _ in range(WINDOW):
            await ask()
        while inflight:
            req, data = await dealer.recv_multipart()
            inflight -= 1
            await ask()
            await asyncio.to_thread(os.pwrite, wfd, data, struct.unpack("!Q", req)[0])
    finally:
        if server is not None:
            server.cancel()
        os.close(rfd)
        os.close(wfd)
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


# -- meshd ----------------------------------------------------------------------------


def meshd_case(holders: int, secured: bool, manifest: Manifest) -> Case:
    async def run(src: Path, dest: Path) -> None:
        ctx = zmq.asyncio.Context()
        # One pair for every holder and the fetcher: the handshake's cost is the same.
        keys: CurveKeys | None = CurveKeys.generate() if secured else None
        zap = None
        if keys is not None:
            admitted = keys.public
            zap = start_zap(ctx, lambda key: key == admitted, lambda: None)

        def prepare(_ask: wire.SliceAsk) -> tuple[Path, Manifest]:
            return src, manifest  # hashed once, before timing: a holder caches it

        servers = [
            WeightServer(ctx, prepare=prepare, bind_host="127.0.0.1", keys=keys)
            for _ in range(holders)
        ]
        addrs = [wire.Addr(node=f"h{i}", addresses=["127.0.0.1"], port=s.port)
                 for i, s in enumerate(servers)]  # fmt: skip
        try:
            for s in servers:
                s.start()
            await fetch_slice(ctx, holders=lambda: addrs, ask=ASK, dest=dest,
                              own_addresses=["127.0.0.1"], keys=keys,
                              server_key=lambda _n: keys.public if keys else None)  # fmt: skip
        finally:
            for s in servers:
                await s.stop()
            if zap is not None:
                zap.stop()
            ctx.term()

    return run


# -- driver ---------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256, help="file size in MiB (256)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every case (3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    ap.add_argument("--dir", type=Path, default=None, help="where the temp files go")
    args = ap.parse_args()
    size = args.size_mb << 20
    tmp = Path(tempfile.mkdtemp(prefix="meshd-transfer-", dir=args.dir))
    try:
        src = tmp / "source.bin"
        log(f"writing {args.size_mb} MiB of random bytes to {src}")
        want = write_source(src, size)
        manifest = build_manifest(src, slice_id(SHA, ASK.start, ASK.end), CHUNK_BYTES)
        cases: dict[str, Case] = {
            "baseline (plain zmq)": plain_copy,
            "meshd, 1 holder": meshd_case(1, False, manifest),
            "meshd, 2 holders": meshd_case(2, False, manifest),
            "meshd, 1 holder, CURVE": meshd_case(1, True, manifest),
        }
        rates: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(-args.warmup, args.repeat):  # r < 0: warm-up, not counted
            for name, case in cases.items():
                dest = tmp / "fetched" / "copy.bin"
                dest.parent.mkdir(exist_ok=True)
                t0 = time.perf_counter()
                asyncio.run(case(src, dest))
                took = time.perf_counter() - t0
                got = sha_of(dest)
                if got != want:
                    sys.exit(f"FAILED: {name}: sha256 {got} of the copy, {want} of the source")
                if r >= 0:
                    rates[name].append(size / took / 1e6)
                tag = f"repeat {r + 1}/{args.repeat}" if r >= 0 else "warm-up"
                log(f"{tag}: {name}: {size / took / 1e6:.0f} MB/s")
                shutil.rmtree(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = med(rates["baseline (plain zmq)"])
    rows = [[name, f"{med(xs):.0f}", spread(xs, "{:.0f}"), f"{med(xs) / base:.3f}"]
            for name, xs in rates.items()]  # fmt: skip
    print(f"\n{args.size_mb} MiB over loopback, {CHUNK_BYTES >> 20} MiB chunks, window {WINDOW}, "
          f"median of {args.repeat} (sha256 of every copy checked):")  # fmt: skip
    print(table(rows, ["case", "MB/s", "min-max", "ratio to baseline"]))
    one = med(rates["meshd, 1 holder"]) / base
    print(f"\ngoal: meshd 1 holder / baseline >= {GOAL}: {one:.3f}, "
          f"{'met' if one >= GOAL else 'NOT met'}")  # fmt: skip


if __name__ == "__main__":
    main()

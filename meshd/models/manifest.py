"""What a slice is, by content: its id, its chunks and their sha256 digests.

A node that lacks a model fetches its stage's slice from the nodes that hold the model
(``meshd.transport.transfer``). Slices are content addressed: a slice's id is derived
from the model file's sha256, the layer range and :data:`SLICE_FORMAT_VERSION`, so two
holders of the same file offer the same id for the same bytes (cutting is
deterministic), and a change to the slicing format can never be mistaken for the old
one. The bytes travel in :data:`CHUNK_BYTES` chunks, each checked against its digest
in the :class:`Manifest` before it is written; the manifest's :attr:`Manifest.root`
(sha256 of the digests) is what two holders must agree on.

The holder hashes a slice once and keeps the manifest beside it in its cache, valid
while the file keeps its size and mtime.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import msgspec

from .atomic import written_whole

__all__ = [
    "CHUNK_BYTES",
    "DIGEST_BYTES",
    "SLICE_FORMAT_VERSION",
    "Manifest",
    "build_manifest",
    "manifest_for",
    "read_manifest",
    "slice_id",
    "verified_chunks",
    "write_manifest",
]

#: Bumped whenever ``meshd.models.slicing`` would cut different bytes for a range
#: (2: sliding-window layers as a per-layer array).
SLICE_FORMAT_VERSION = 2
#: Bytes per chunk: large enough that per-chunk costs vanish on a LAN, small enough
#: that a window of them in flight stays a few tens of MiB.
CHUNK_BYTES = 4 << 20
DIGEST_BYTES = 32


def slice_id(sha256: str, start: int, end: int, version: int = SLICE_FORMAT_VERSION) -> str:
    """Content id of layers ``[start, end)`` of the model file with ``sha256``."""
    text = f"meshd-slice:v{version}:{sha256}:{start}:{end}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A slice's size, chunk size and the sha256 of every chunk (concatenated)."""

    slice: str
    size: int
    chunk: int
    digests: bytes
    #: The file hashed, as it was then (a manifest of a changed file is stale).
    source_size: int = 0
    source_mtime_ns: int = 0

    @property
    def count(self) -> int:
        """Number of chunks (an empty slice has none)."""
        return -(-self.size // self.chunk) if self.size else 0

    @property
    def root(self) -> str:
        """sha256 of the digests: one value that names every byte of the slice."""
        return hashlib.sha256(self.digests).hexdigest()

    def digest(self, index: int) -> bytes:
        """The sha256 chunk ``index`` must have."""
        return self.digests[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]

    def span(self, index: int) -> tuple[int, int]:
        """Offset and length of chunk ``index``."""
        off = index * self.chunk
        return off, min(self.chunk, self.size - off)

    def consistent(self) -> bool:
        """Sizes and digests agree (what a peer's offer must pass before it is used)."""
        return self.size >= 0 and self.chunk > 0 and len(self.digests) == self.count * DIGEST_BYTES


def build_manifest(path: Path, sid: str, chunk: int = CHUNK_BYTES) -> Manifest:
    """Hash ``path`` chunk by chunk (reads the whole file once)."""
    st = os.stat(path)
    digests = bytearray()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digests += hashlib.sha256(block).digest()
    return Manifest(
        slice=sid, size=st.st_size, chunk=chunk, digests=bytes(digests),
        source_size=st.st_size, source_mtime_ns=st.st_mtime_ns,
    )  # fmt: skip


def read_manifest(file: Path) -> Manifest | None:
    """The manifest stored in ``file``, or None (missing, unreadable, not one)."""
    try:
        m = msgspec.msgpack.decode(Path(file).read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return m if m.consistent() else None


def write_manifest(file: Path, manifest: Manifest) -> None:
    """Store ``manifest`` in ``file`` (written whole or not at all)."""
    with written_whole(Path(file)) as tmp:
        tmp.write_bytes(msgspec.msgpack.encode(manifest))


def manifest_for(path: Path, sid: str, store: Path, chunk: int = CHUNK_BYTES) -> Manifest:
    """The manifest of ``path`` under id ``sid``: the one kept in ``store`` while the
    file has not changed since, else hashed now and kept there."""
    st = os.stat(path)
    m = read_manifest(store)
    if (
        m is not None
        and m.slice == sid
        and m.chunk == chunk
        and m.source_size == st.st_size
        and m.source_mtime_ns == st.st_mtime_ns
    ):
        return m
    m = build_manifest(path, sid, chunk)
    with contextlib.suppress(OSError):  # a read-only cache only costs a rehash later
        write_manifest(store, m)
    return m


def verified_chunks(path: Path, manifest: Manifest) -> set[int]:
    """Indices of the chunks of a partial file that already hold the right bytes: what
    a resumed fetch need not fetch again (nothing is trusted without its digest)."""
    done: set[int] = set()
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError:
        return done
    with f:
        for i in range(manifest.count):
            off, n = manifest.span(i)
            f.seek(off)
            block = f.read(n)
            if len(block) == n and hashlib.sha256(block).digest() == manifest.digest(i):
                done.add(i)
    return done

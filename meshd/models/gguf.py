"""GGUF headers: key/values and tensor descriptors, read without loading the file.

One small reader of our own rather than ``gguf.GGUFReader``: that one builds numpy views
of every vocabulary string (2-4 s on a 49k-token vocabulary, most of a fresh node's time
to its first token); this memory-maps the file and skips what it does not need
(~0.05-0.1 s), cheap enough for the API path. Both byte orders, GGUF v2 and v3.
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelFormatError
from .quant_types import GGML_TYPES

__all__ = [
    "GgufHeader",
    "KvRecord",
    "check_gguf_file",
    "encode_kv",
    "is_gguf",
    "read_header",
    "read_kv_records",
    "read_metadata",
]

GGUF_MAGIC = b"GGUF"
#: GGUF value types with a fixed size: type id -> struct format.
_GGUF_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_GGUF_STRING = 8
_GGUF_ARRAY = 9
#: Numeric arrays up to this length are read (per-layer head counts); longer ones
#: (token types, scores) and string arrays (the vocabulary) are skipped.
_GGUF_ARRAY_READ_MAX = 4096
#: Arrays of arrays this deep at most (llama.cpp reads none; a file nested a thousand
#: deep must be a clear error, not a RecursionError).
_GGUF_MAX_DEPTH = 2
#: The fewest bytes one item of each type takes: a count that needs more than the
#: file holds is refused before anything loops over it.
_GGUF_MIN_BYTES = {_GGUF_STRING: 8, _GGUF_ARRAY: 12}
#: Dimensions of a tensor at most (GGML_MAX_DIMS is 4).
_GGUF_MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """A GGUF header: key/values (big arrays left out) and tensor descriptors."""

    kv: dict[str, Any]
    #: name -> (GGUF type name such as ``Q4_1``, shape with ``ne[0]`` first).
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    #: name -> bytes of the tensor's data in the file.
    nbytes: dict[str, int]
    #: name -> where the tensor's data starts in the file (bytes from its start).
    offsets: dict[str, int]
    #: A hash of the token list (``tokenizer.ggml.tokens``, as stored, trailing
    #: ``[PAD<i>]`` entries left out): two models with the same one give a token id
    #: the same text ("" when there is none).
    vocab_hash: str = ""


class _Cursor:
    """Sequential reader over a GGUF header: an offset and struct calls."""

    def __init__(self, buf: mmap.mmap, path: Path | str) -> None:
        if buf[:4] != GGUF_MAGIC:
            raise ModelFormatError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        # The version is a small number, so its byte order gives the file's.
        self.order = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        version = struct.unpack_from(self.order + "I", buf, 4)[0]
        if version not in (2, 3):
            raise ModelFormatError(f"{path}: unsupported GGUF version {version}")
        self.buf = buf
        self.path = path
        self.pos = 8

    def scalar(self, kind: int) -> Any:
        fmt = _GGUF_SCALARS.get(kind)
        if fmt is None:
            raise ModelFormatError(f"{self.path}: unknown GGUF value type {kind}")
        (v,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def count(self, kind: int, what: str) -> int:
        """A count of items of type ``kind`` at the cursor, refused when the rest of the
        file could not hold that many."""
        n = int(self.scalar(10))
        size = _GGUF_MIN_BYTES.get(kind) or struct.calcsize(_GGUF_SCALARS.get(kind, "B"))
        if n * size > len(self.buf) - self.pos:
            raise ModelFormatError(
                f"{self.path}: GGUF header claims {n} {what}, more than the file holds"
            )
        return n

    def string(self) -> str:
        n = self.scalar(10)
        end = self.pos + n
        if end > len(self.buf):
            raise ModelFormatError(f"{self.path}: GGUF header is truncated")
        text = bytes(self.buf[self.pos : end]).decode("utf-8", "replace")
        self.pos = end
        return text

    def skip_strings(self, count: int) -> None:
        """Read past ``count`` strings by their lengths. A vocabulary and its merges
        are 100k strings: decoding each only to drop it took a second a read."""
        buf, order, pos = self.buf, self.order + "Q", self.pos
        for _ in range(count):
            pos += 8 + struct.unpack_from(order, buf, pos)[0]
        if pos > len(buf):
            raise ModelFormatError(f"{self.path}: GGUF header is truncated")
        self.pos = pos

    def token_list_hash(self) -> str:
        """Read past a string array (the cursor at its item type) and return a hash
        of its stored bytes up to its last entry that is not padding: converters pad
        a vocabulary to the embedding's rows with ``[PAD<i>]`` entries, and two sizes
        of one family (Qwen2.5 0.5B and 7B) differ only there."""
        item = self.scalar(4)
        count = self.count(item, "tokens")
        if item != _GGUF_STRING:
            for _ in range(count):
                self.value(item, arrays=False, depth=1)
            return ""
        start = end = self.pos
        buf, order = self.buf, self.order + "Q"
        for _ in range(count):
            (n,) = struct.unpack_from(order, buf, self.pos)
            body = self.pos + 8
            if buf[body : body + 4] != b"[PAD":
                end = body + n
            self.pos = body + n
        if self.pos > len(buf):
            raise ModelFormatError(f"{self.path}: GGUF header is truncated")
        return hashlib.blake2b(buf[start:end], digest_size=16).hexdigest()

    def value(self, kind: int, arrays: bool, depth: int = 0) -> Any:
        """The value of type ``kind`` at the cursor; an array is read only when
        ``arrays`` and numeric and short (else skipped: None). ``depth``: the arrays
        this value is in."""
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            return self.scalar(kind)
        if depth >= _GGUF_MAX_DEPTH:
            raise ModelFormatError(f"{self.path}: GGUF arrays nested deeper than {depth}")
        item = self.scalar(4)
        count = self.count(item, "array items")
        fmt = _GGUF_SCALARS.get(item)
        if item == _GGUF_STRING:
            self.skip_strings(count)
            return None
        if fmt is None:
            for _ in range(count):
                self.value(item, arrays=False, depth=depth + 1)
            return None
        size = count * struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelFormatError(f"{self.path}: GGUF header is truncated")
        if not arrays or count > _GGUF_ARRAY_READ_MAX:
            self.pos += size
            return None
        items = list(struct.unpack_from(f"{self.order}{count}{fmt}", self.buf, self.pos))
        self.pos += size
        return items


@dataclass(frozen=True, slots=True)
class KvRecord:
    """One key/value of a GGUF header as stored: its bytes (key included), to copy as
    they are, and its value (None for a long or a string array)."""

    key: str
    #: The GGUF value type, and an array's item type (None for a scalar or string).
    kind: int
    item: int | None
    value: Any
    raw: bytes


#: What struct and index arithmetic raise on bytes that stop making sense.
_CORRUPT = (struct.error, IndexError, OverflowError)


def _truncated(path: Path | str, e: Exception) -> ModelFormatError:
    return ModelFormatError(f"{path}: truncated or corrupt GGUF header ({e})")


def check_gguf_file(path: Path) -> None:
    """Raise FileNotFoundError when ``path`` is no file, ModelFormatError when it does
    not start like a GGUF."""
    if not path.is_file():
        raise FileNotFoundError(f"no model file at {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(f"{path} is not a GGUF file (magic {magic!r})")


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts like a GGUF."""
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _stamp(path: str | Path) -> tuple[str, int, int, int, int]:
    """What a header read is cached by: the file's path, identity, size and mtime (a
    file rewritten in place, as slicing never does, is read again)."""
    st = os.stat(path)
    return os.fspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_metadata(path: str | Path, *, keys: Collection[str] | None = None) -> dict[str, Any]:
    """Scalar and string key/values of a GGUF header (arrays such as the vocabulary
    are left out); only those of ``keys`` when given.

    Raises :class:`ModelFormatError` (a ``ValueError``) on a file that is not GGUF or
    whose header is truncated.
    """
    # A read walks the vocabulary (~35 ms for 100k strings) unless every key asked
    # comes before it, and a stage's load asks ~10 times: read whole, once per file
    # version in this process.
    full = _all_metadata(*_stamp(path))
    return dict(full) if keys is None else {k: full[k] for k in keys if k in full}


@functools.lru_cache(maxsize=32)
def _all_metadata(path: str, *_stamp: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        try:
            cur.scalar(10)  # tensor count
            for _ in range(cur.count(_GGUF_ARRAY, "key/values")):
                key = cur.string()
                kind = cur.scalar(4)
                v = cur.value(kind, arrays=False)
                if kind != _GGUF_ARRAY:
                    out[key] = v
        except _CORRUPT as e:
            raise _truncated(path, e) from e
    return out


def read_header(path: Path) -> GgufHeader:
    """Read a GGUF header: every key/value (short numeric arrays included) and every
    tensor's type, shape and size. Read once per file version in this process: the
    header returned is shared, not to be changed.

    Raises ModelFormatError for a file that is not GGUF v2/v3 or is truncated,
    FileNotFoundError for a missing one.
    """
    if not path.is_file():
        raise FileNotFoundError(f"no model file at {path}")
    return _read_header(*_stamp(path))


@functools.lru_cache(maxsize=32)
def _read_header(name: str, *_stamp: int) -> GgufHeader:
    path = Path(name)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        try:
            n_tensors = cur.scalar(10)
            n_kv = cur.count(_GGUF_ARRAY, "key/values")
            if n_tensors * 24 > len(buf):  # a name, dims, type, offset: 24 bytes at least
                raise ModelFormatError(f"{path}: GGUF header claims {n_tensors} tensors")
            kv: dict[str, Any] = {}
            vocab_hash = ""
            for _ in range(n_kv):
                key = cur.string()
                kind = cur.scalar(4)
                if key == "tokenizer.ggml.tokens" and kind == _GGUF_ARRAY:
                    vocab_hash = cur.token_list_hash()
                    kv[key] = None  # as any long array: skipped
                else:
                    kv[key] = cur.value(kind, arrays=True)
            tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
            nbytes: dict[str, int] = {}
            starts: list[int] = []
            relative: dict[str, int] = {}
            unsized: list[tuple[int, str]] = []
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = cur.scalar(4)
                if n_dims > _GGUF_MAX_DIMS:
                    raise ModelFormatError(f"{path}: tensor {name[:80]!r} has {n_dims} dims")
                shape = tuple(cur.scalar(10) for _ in range(n_dims))
                kind = cur.scalar(4)
                offset = cur.scalar(10)
                relative[name] = offset
                known = GGML_TYPES.get(kind)
                if known is None:
                    # A type newer than this table: llama.cpp may still run it; its
                    # size comes from where the next tensor starts (below).
                    tensors[name] = (f"type {kind}", shape)
                    unsized.append((offset, name))
                    continue
                type_name, block_size, type_size = known
                tensors[name] = (type_name, shape)
                nbytes[name] = math.prod(shape) // block_size * type_size
                starts.append(offset)
        except _CORRUPT as e:
            raise _truncated(path, e) from e
        align = kv.get("general.alignment") or 32
        if not isinstance(align, int) or align <= 0 or align & (align - 1) or align > 1 << 20:
            raise ModelFormatError(f"{path}: GGUF general.alignment {align!r} is no power of 2")
        data_start = -(-cur.pos // align) * align
        if unsized:
            ends = sorted(starts + [o for o, _ in unsized] + [len(buf) - data_start])
            for offset, name in unsized:
                end = next((e for e in ends if e > offset), None)
                if end is None:
                    raise ModelFormatError(f"{path}: tensor {name[:80]!r} starts past the end")
                nbytes[name] = end - offset
    offsets = {name: data_start + o for name, o in relative.items()}
    return GgufHeader(kv=kv, tensors=tensors, nbytes=nbytes, offsets=offsets, vocab_hash=vocab_hash)


def read_kv_records(path: Path) -> tuple[str, int, list[KvRecord]]:
    """The byte order (``<`` or ``>``), the GGUF version and every key/value record of
    ``path``'s header, in file order (slicing copies them). Raises ModelFormatError for
    a file that is not GGUF v2/v3 or is truncated. Read once per file version in this
    process (cutting several slices of one model reads it once)."""
    order, version, records = _read_kv_records(*_stamp(path))
    return order, version, list(records)


@functools.lru_cache(maxsize=8)
def _read_kv_records(path: str, *_stamp: int) -> tuple[str, int, tuple[KvRecord, ...]]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        version = struct.unpack_from(cur.order + "I", buf, 4)[0]
        records = []
        try:
            cur.scalar(10)  # tensor count
            for _ in range(cur.count(_GGUF_ARRAY, "key/values")):
                start = cur.pos
                key = cur.string()
                kind = cur.scalar(4)
                item = None
                if kind == _GGUF_ARRAY:
                    item = struct.unpack_from(cur.order + "I", buf, cur.pos)[0]
                value = cur.value(kind, arrays=True)
                records.append(KvRecord(key, kind, item, value, bytes(buf[start : cur.pos])))
        except _CORRUPT as e:
            raise _truncated(path, e) from e
    return cur.order, version, tuple(records)


def encode_kv(order: str, key: str, kind: int, value: Any, item: int | None = None) -> bytes:
    """One key/value record as a GGUF header stores it (scalars, strings, arrays of
    either)."""
    return (
        _encode(order, _GGUF_STRING, key)
        + struct.pack(order + "I", kind)
        + (_encode(order, kind, value, item))
    )


def _encode(order: str, kind: int, value: Any, item: int | None = None) -> bytes:
    if kind == _GGUF_STRING:
        b = str(value).encode()
        return struct.pack(order + "Q", len(b)) + b
    if kind == _GGUF_ARRAY:
        if item is None or item == _GGUF_ARRAY:
            raise ValueError("an array needs a scalar or string item type")
        head = struct.pack(order + "IQ", item, len(value))
        return head + b"".join(_encode(order, item, v) for v in value)
    return struct.pack(order + _GGUF_SCALARS[kind], value)

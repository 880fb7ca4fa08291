"""A GGUF made to hurt the header reader: a clear ModelFormatError (a 400), never a
traceback, a hang or a huge allocation. Pure: small files written byte by byte."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from meshd.api.errors import node_error
from meshd.models.errors import ModelFormatError
from meshd.models.facts import read_facts
from meshd.models.gguf import read_header, read_metadata

U8, U32, U64, STR, ARR = 0, 4, 10, 8, 9


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", kind) + payload


def _gguf(
    kvs: list[bytes], tensors: bytes = b"", n_tensors: int = 0, n_kv: int | None = None
) -> bytes:
    n = len(kvs) if n_kv is None else n_kv
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n) + b"".join(kvs) + tensors + bytes(64)


def _nested(depth: int) -> bytes:
    # An array of one array of one array ... of nothing.
    return struct.pack("<IQ", ARR, 1) * depth + struct.pack("<IQ", U8, 0)


ARCH = _kv("general.architecture", STR, _s("llama"))
HOSTILE = {
    "nested_arrays": _gguf([_kv("x", ARR, _nested(5000))]),
    "array_longer_than_the_file": _gguf([_kv("x", ARR, struct.pack("<IQ", U32, 1 << 62))]),
    "strings_longer_than_the_file": _gguf([_kv("x", ARR, struct.pack("<IQ", STR, 1 << 40))]),
    "more_keys_than_the_file_holds": _gguf([ARCH], n_kv=1 << 50),
    "more_tensors_than_the_file_holds": _gguf([ARCH], n_tensors=1 << 40),
    "alignment_of_3": _gguf([ARCH, _kv("general.alignment", U32, struct.pack("<I", 3))]),
    "a_billion_layers": _gguf([ARCH, _kv("llama.block_count", U64, struct.pack("<Q", 1 << 40)),
                               _kv("llama.embedding_length", U32, struct.pack("<I", 8))]),
    "a_tensor_of_2e9_dims": _gguf(
        [ARCH], n_tensors=1, tensors=_s("t") + struct.pack("<I", 1 << 31) + bytes(64)
    ),
}  # fmt: skip


KEY_VALUES = {"nested_arrays", "array_longer_than_the_file", "strings_longer_than_the_file",
              "more_keys_than_the_file_holds"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_header_is_a_format_error_and_a_400(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(HOSTILE[name])
    with pytest.raises(ModelFormatError) as e:
        read_facts(path, "m", sha256="0" * 64)
    assert str(path) in str(e.value)
    if name != "a_billion_layers":  # (a well-formed header: only its facts are absurd)
        with pytest.raises(ModelFormatError):
            read_header(path)
    if name in KEY_VALUES:  # (what read_metadata reads: the rest is well-formed there)
        with pytest.raises(ModelFormatError):
            read_metadata(path)
    err = node_error(e.value, "m", placing=True)
    assert err is not None and err.status == 400


def test_arrays_of_short_arrays_still_read(tmp_path: Path) -> None:
    inner = struct.pack("<IQ", U8, 2) + b"\x01\x02"
    path = tmp_path / "ok.gguf"
    path.write_bytes(_gguf([ARCH, _kv("x", ARR, struct.pack("<IQ", ARR, 2) + inner * 2)]))
    assert read_header(path).kv["general.architecture"] == "llama"

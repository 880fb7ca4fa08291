"""Read what placement needs to know about a GGUF model from its metadata.

Every number comes from the file itself (``<arch>.block_count``, tensor sizes, ...):
nothing about a particular model is hard-coded here, so a new GGUF works as soon as
llama.cpp can load it. The reader memory-maps the file, so only the header is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import msgspec

from meshd.crdt.views import ModelFacts

__all__ = [
    "MLX_TYPES",
    "GgufHeader",
    "ModelFormatError",
    "SpecialTokens",
    "architecture",
    "file_sha256",
    "open_gguf",
    "read_facts",
    "read_header",
    "special_tokens",
]

#: GGUF tensor types that ``mx.load`` reads with correct values (ENGINE-NOTES): Q4_K
#: loads with wrong values and Q5_0/Q2_K/Q3_K/IQ4_NL do not load, so a model holding
#: any other type is not offered to the MLX engine.
MLX_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q6_K"})

#: f16 K and V cache entries: the type llama.cpp uses by default.
_KV_ELEMENT_BYTES = 2

_BLK = re.compile(r"^blk\.(\d+)\.")

#: Hash files in 8 MiB reads: large enough that Python overhead vanishes.
_HASH_CHUNK = 8 << 20


class ModelFormatError(ValueError):
    """The file is not a GGUF model this code can read (bad magic, truncated, ...)."""


class SpecialTokens(msgspec.Struct, frozen=True):
    """Special token ids from the GGUF tokenizer metadata (None where absent)."""

    bos: int | None = None
    eos: int | None = None
    eot: int | None = None


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file for reading, turning any parse failure into ModelFormatError.

    A missing file raises FileNotFoundError (a caller may want to fetch it); anything
    that is there but does not parse is a ModelFormatError.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no model file at {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        # GGUFReader reports bad files with ValueError, IndexError, struct and numpy
        # errors depending on where the bytes stop making sense: one typed error here.
        raise ModelFormatError(f"{path} is not a readable GGUF file: {e}") from e


#: GGUF value types with a fixed size: type id -> struct format.
_GGUF_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_GGUF_STRING = 8
_GGUF_ARRAY = 9
#: Numeric arrays up to this length are read (per-layer head counts); longer ones
#: (token types, scores) and string arrays (the vocabulary) are skipped.
_GGUF_ARRAY_READ_MAX = 4096


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """A GGUF header: key/values (big arrays left out) and tensor descriptors."""

    kv: dict[str, Any]
    #: name -> (GGUF type name such as ``Q4_1``, shape with ``ne[0]`` first).
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    #: name -> bytes of the tensor's data in the file.
    nbytes: dict[str, int]


def read_header(path: Path) -> GgufHeader:
    """Read a GGUF header with plain struct calls.

    ``gguf.GGUFReader`` builds numpy views of every vocabulary string (2-4 s on a
    49k-token vocabulary, most of a fresh node's time to its first token); this
    skips them (~0.1 s), cheap enough for the API path. Raises ModelFormatError for
    a file that is not GGUF v2/v3 or is truncated, FileNotFoundError for a missing
    one.
    """
    if not path.is_file():
        raise FileNotFoundError(f"no model file at {path}")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelFormatError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        # The version is a small number, so its byte order gives the file's.
        order = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        version = struct.unpack_from(order + "I", buf, 4)[0]
        if version not in (2, 3):
            raise ModelFormatError(f"{path}: unsupported GGUF version {version}")
        pos = 8

        def scalar(kind: int) -> Any:
            nonlocal pos
            fmt = order + _GGUF_SCALARS[kind]
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = scalar(10)
            text = bytes(buf[pos : pos + n]).decode("utf-8", "replace")
            pos += n
            return text

        def value(kind: int) -> Any:
            nonlocal pos
            if kind == _GGUF_STRING:
                return string()
            if kind != _GGUF_ARRAY:
                if kind not in _GGUF_SCALARS:
                    raise ModelFormatError(f"{path}: unknown GGUF value type {kind}")
                return scalar(kind)
            item, count = scalar(4), scalar(10)
            fmt = _GGUF_SCALARS.get(item)
            if fmt is not None:
                size = count * struct.calcsize(fmt)
                if count > _GGUF_ARRAY_READ_MAX:
                    pos += size
                    return None
                items = list(struct.unpack_from(f"{order}{count}{fmt}", buf, pos))
                pos += size
                return items
            for _ in range(count):
                value(item)
            return None

        try:
            n_tensors, n_kv = scalar(10), scalar(10)
            kv: dict[str, Any] = {}
            for _ in range(n_kv):
                key = string()
                kv[key] = value(scalar(4))
            tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
            nbytes: dict[str, int] = {}
            starts: list[int] = []
            unsized: list[tuple[int, str]] = []
            for _ in range(n_tensors):
                name = string()
                shape = tuple(scalar(10) for _ in range(scalar(4)))
                kind = scalar(4)
                offset = scalar(10)
                try:
                    qtype = gguf.GGMLQuantizationType(kind)
                except ValueError:
                    # A type newer than this gguf package: llama.cpp may still run it;
                    # its size comes from where the next tensor starts (below).
                    tensors[name] = (f"type {kind}", shape)
                    unsized.append((offset, name))
                    continue
                block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
                tensors[name] = (qtype.name, shape)
                nbytes[name] = math.prod(shape) // block_size * type_size
                starts.append(offset)
        except (struct.error, IndexError, ValueError) as e:
            if isinstance(e, ModelFormatError):
                raise
            raise ModelFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from e
        if unsized:
            align = int(kv.get("general.alignment") or 32)
            data_start = -(-pos // align) * align
            ends = sorted(starts + [o for o, _ in unsized] + [len(buf) - data_start])
            for offset, name in unsized:
                nbytes[name] = next(e for e in ends if e > offset) - offset
    return GgufHeader(kv=kv, tensors=tensors, nbytes=nbytes)


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _int(kv: dict[str, Any], key: str) -> int | None:
    v = kv.get(key)
    if v is None:
        return None
    # Some architectures store per-layer head counts as an array: size for the
    # largest layer so the KV estimate never comes out short.
    return int(max(v) if isinstance(v, list) else v)


def _required_int(kv: dict[str, Any], key: str, path: Path) -> int:
    v = _int(kv, key)
    if v is None:
        raise ModelFormatError(f"{path}: GGUF metadata lacks {key!r}")
    return v


def architecture(reader: gguf.GGUFReader, path: Path | str = "") -> str:
    """The ``general.architecture`` of an open GGUF file."""
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFormatError(f"{path}: GGUF metadata lacks general.architecture")
    return arch


def read_facts(
    path: Path, name: str, sha256: str | None = None, cache_dir: Path | None = None
) -> ModelFacts:
    """Read a GGUF model's placement facts from its metadata.

    ``name`` is what the user asked for (alias, path or repo id). ``sha256`` may be
    passed when already known; otherwise the file is hashed (cached in ``cache_dir``
    when given, see :func:`file_sha256`). Raises ModelFormatError for a file that is
    not a usable GGUF model, FileNotFoundError for a missing one.
    """
    path = Path(path)
    cached = _cached_facts(path, cache_dir)
    if cached is not None:
        return msgspec.structs.replace(cached, name=name)
    facts = _read_facts(path, name, sha256, cache_dir)
    _cache_facts(path, cache_dir, facts)
    return facts


_FACTS_FILE = "facts.json"


def _facts_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _cached_facts(path: Path, cache_dir: Path | None) -> ModelFacts | None:
    """Facts parsed before for this very file (same path, size and mtime)."""
    if cache_dir is None:
        return None
    try:
        table = json.loads((Path(cache_dir) / _FACTS_FILE).read_text())
        raw = table.get(_facts_key(path))
        return None if raw is None else msgspec.convert(raw, ModelFacts)
    except (OSError, ValueError, msgspec.ValidationError):
        return None


def _cache_facts(path: Path, cache_dir: Path | None, facts: ModelFacts) -> None:
    if cache_dir is None:
        return
    f = Path(cache_dir) / _FACTS_FILE
    try:
        table = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError):
        table = {}
    key = _facts_key(path)
    prefix = key.rsplit("|", 2)[0] + "|"
    table = {k: v for k, v in table.items() if not k.startswith(prefix)}
    table[key] = msgspec.to_builtins(facts)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table))
    os.replace(tmp, f)


def _read_facts(path: Path, name: str, sha256: str | None, cache_dir: Path | None) -> ModelFacts:
    header = read_header(path)
    kv = header.kv
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFormatError(f"{path}: GGUF metadata lacks general.architecture")
    n_layers = _required_int(kv, f"{arch}.block_count", path)
    hidden = _required_int(kv, f"{arch}.embedding_length", path)
    n_ctx_train = _int(kv, f"{arch}.context_length") or 0
    n_head = _int(kv, f"{arch}.attention.head_count") or 0
    # Grouped-query attention: K/V heads default to the query heads when absent.
    n_head_kv = _int(kv, f"{arch}.attention.head_count_kv") or n_head
    # key_length/value_length are explicit for models whose head dim is not
    # hidden / heads (e.g. Gemma); otherwise llama.cpp derives it the same way.
    head_dim = hidden // n_head if n_head else 0
    k_len = _int(kv, f"{arch}.attention.key_length") or head_dim
    v_len = _int(kv, f"{arch}.attention.value_length") or k_len

    layer_bytes = [0] * n_layers
    embed_bytes = 0
    head_bytes = 0
    types: set[str] = set()
    for tname, (type_name, _shape) in header.tensors.items():
        types.add(type_name)
        nbytes = header.nbytes[tname]
        m = _BLK.match(tname)
        if m is not None:
            i = int(m.group(1))
            # Tensors past block_count (e.g. next-token-prediction layers) are not
            # loaded by llama.cpp as layers; leave them out of the layer sizes.
            if i < n_layers:
                layer_bytes[i] += nbytes
        elif tname in ("output.weight", "output_norm.weight", "output_norm.bias"):
            head_bytes += nbytes
        else:
            # token_embd.weight plus the small global tensors (rope_freqs, ...) that
            # every llama.cpp slice carries: count them where every stage pays them.
            embed_bytes += nbytes

    quant_types = sorted(types)
    engines = ["llama_cpp"]
    if types <= MLX_TYPES:
        # Any other type either fails to load in mx.load or, worse (Q4_K), loads
        # with wrong values: such a model must never be placed on an MLX stage.
        engines.append("mlx")

    return ModelFacts(
        name=name,
        sha256=sha256 if sha256 is not None else file_sha256(path, cache_dir),
        format="gguf",
        architecture=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        n_ctx_train=n_ctx_train,
        layer_bytes=layer_bytes,
        embed_bytes=embed_bytes,
        head_bytes=head_bytes,
        kv_bytes_per_token_layer=n_head_kv * (k_len + v_len) * _KV_ELEMENT_BYTES,
        quant_types=quant_types,
        engines=engines,
    )


def special_tokens(path: Path) -> SpecialTokens:
    """bos/eos/eot token ids from a GGUF's tokenizer metadata."""
    kv = read_header(path).kv

    def tid(key: str) -> int | None:
        v = kv.get(f"tokenizer.ggml.{key}_token_id")
        return None if v is None else int(v)

    return SpecialTokens(bos=tid("bos"), eos=tid("eos"), eot=tid("eot"))


def _cache_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _load_cache(file: Path) -> dict[str, str]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items()}


def _store_cache(file: Path, entries: dict[str, str]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename: a reader never sees half a JSON file.
    # Two processes racing may drop each other's new entry; that costs one re-hash.
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".sha256.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=0, sort_keys=True)
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path, cache_dir: Path | None = None) -> str:
    """sha256 (hex) of a file, cached in ``cache_dir/sha256.json`` when given.

    The cache is keyed by (absolute path, size, mtime_ns): a model is hashed once
    and re-hashed only when the file changes. Without ``cache_dir`` it always hashes.
    """
    path = Path(path)
    if cache_dir is None:
        return _hash_file(path)
    cache_file = Path(cache_dir) / "sha256.json"
    key = _cache_key(path)
    entries = _load_cache(cache_file)
    hit = entries.get(key)
    if hit is not None:
        return hit
    digest = _hash_file(path)
    # Re-read just before writing so entries another process added meanwhile stay.
    entries = _load_cache(cache_file)
    entries[key] = digest
    _drop_stale(entries, path)
    _store_cache(cache_file, entries)
    return digest


def _drop_stale(entries: dict[str, str], path: Path) -> None:
    """Forget older (size, mtime) entries of the same path: they can never hit again."""
    prefix = f"{path.resolve()}|"
    current = _cache_key(path)
    for k in [k for k in entries if k.startswith(prefix) and k != current]:
        del entries[k]

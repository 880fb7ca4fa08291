"""What placement needs to know about a model, read from its own files.

Every number comes from the model itself (``<arch>.block_count``, tensor sizes, ...):
nothing about a particular model is hard-coded here, so a new GGUF works as soon as
llama.cpp can load it. Only headers are read. GGUF facts are cached in
``cache_dir/facts-v<N>.json`` by (path, size, mtime).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from meshd.domain.builds import buildable_engines
from meshd.domain.facts import ModelFacts

from .atomic import written_whole
from .errors import ModelFormatError, UnsupportedModelError
from .folder import read_folder_facts
from .generation import gguf_sampling
from .gguf import GgufHeader, read_header
from .hashing import file_key, file_sha256
from .mlx_layout import gguf_layout
from .projectors import find_projector
from .resolve import ResolvedModel, resolve_model

__all__ = ["read_facts", "read_model_facts", "read_resolved_facts"]

#: f16 K and V cache entries: the type llama.cpp uses by default.
_KV_ELEMENT_BYTES = 2

_BLK = re.compile(r"^blk\.(\d+)\.")
#: A block's routed experts, all of them in one tensor (``ffn_up_exps``,
#: ``ffn_gate_up_exps``, their biases); shared experts (``_shexp``) run every token.
_EXPERTS = re.compile(r"^blk\.\d+\.ffn_\w*_exps\b")
#: Tensors of a layer's recurrent state (Mamba's SSM, LFM2's short convolution, RWKV's
#: time mix) and of its attention (a KV cache).
_RECURRENT = re.compile(r"^blk\.\d+\.(ssm_|shortconv\.|time_mix_)")
_ATTENTION = re.compile(r"^blk\.\d+\.attn_(q|k|v|qkv|q_a|kv_a_mqa)\.weight$")
#: Largest layer, head or width count taken from a header: more is a corrupt or
#: hostile file (a list of 2**60 layers would take the reader down).
_MAX_COUNT = 1 << 24


def read_model_facts(
    model: str, cache_dir: Path | str | None, extra_dirs: Sequence[Path | str] = ()
) -> ModelFacts:
    """Facts of the model named ``model`` on this machine (GGUF or MLX folder);
    ``extra_dirs``: the node's ``--models`` folders, where names are looked up too.

    Raises ModelNotFoundError when it is not here, ModelFormatError when it is no
    usable model.
    """
    return read_resolved_facts(resolve_model(model, extra_dirs=extra_dirs), model, cache_dir)


def read_resolved_facts(
    resolved: ResolvedModel, name: str, cache_dir: Path | str | None
) -> ModelFacts:
    """Facts of a model already resolved (a GGUF or an MLX folder), asked for by ``name``."""
    cache = None if cache_dir is None else Path(cache_dir)
    if resolved.format == "mlx":
        return read_folder_facts(Path(resolved.path), name=name, cache_dir=cache)
    return read_facts(Path(resolved.path), name=name, cache_dir=cache)


def read_facts(
    path: Path, name: str, sha256: str | None = None, cache_dir: Path | None = None
) -> ModelFacts:
    """Read a GGUF model's placement facts from its metadata (and the size of its
    image projector, :func:`find_projector`, when one lies beside it).

    ``name`` is what the user asked for (alias, path or repo id). ``sha256`` may be
    passed when already known; otherwise the file is hashed (cached in ``cache_dir``
    when given, see :func:`file_sha256`). Raises ModelFormatError for a file that is
    not a usable GGUF model, FileNotFoundError for a missing one.
    """
    path = Path(path)
    facts = _cached_facts(path, cache_dir)
    if facts is None:
        facts = _read_facts(path, name, sha256, cache_dir)
        _cache_facts(path, cache_dir, facts)
    # Looked for each time, not cached with the model's facts: a projector comes and
    # goes beside a model that stays the same.
    projector = find_projector(path)
    size = projector.stat().st_size if projector is not None else 0
    return msgspec.structs.replace(facts, name=name, projector_bytes=size)


#: Named by version: facts cached by an older meshd lack fields added since, or
#: hold stale ones (v3 had no "mlx" engine for K-quant GGUFs, v4 no vocab_hash, v5 one
#: that counted a vocabulary's padding, v6 no n_params, v7 offered MLX for any
#: architecture, v8 had no active bytes, a MoE model read as dense, nor layer_state).
_FACTS_FILE = "facts-v9.json"


def _cached_facts(path: Path, cache_dir: Path | None) -> ModelFacts | None:
    """Facts parsed before for this very file (same path, size and mtime)."""
    if cache_dir is None:
        return None
    try:
        table = json.loads((Path(cache_dir) / _FACTS_FILE).read_text())
        raw = table.get(file_key(path))
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
    key = file_key(path)
    prefix = key.rsplit("|", 2)[0] + "|"
    table = {k: v for k, v in table.items() if not k.startswith(prefix)}
    table[key] = msgspec.to_builtins(facts)
    with written_whole(f) as tmp:
        tmp.write_text(json.dumps(table))


def _read_facts(path: Path, name: str, sha256: str | None, cache_dir: Path | None) -> ModelFacts:
    header = read_header(path)
    kv = header.kv
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFormatError(f"{path}: GGUF metadata lacks general.architecture")
    n_layers = _required_int(kv, f"{arch}.block_count", path)
    if n_layers > len(header.tensors):
        raise ModelFormatError(
            f"{path}: GGUF block_count {n_layers} but {len(header.tensors)} tensors"
        )
    hidden = _required_int(kv, f"{arch}.embedding_length", path)
    n_ctx_train = _int(kv, f"{arch}.context_length", path) or 0
    n_head = _int(kv, f"{arch}.attention.head_count", path) or 0
    # Grouped-query attention: K/V heads default to the query heads when absent.
    n_head_kv = _int(kv, f"{arch}.attention.head_count_kv", path) or n_head
    # key_length/value_length are explicit for models whose head dim is not
    # hidden / heads (e.g. Gemma); otherwise llama.cpp derives it the same way.
    head_dim = hidden // n_head if n_head else 0
    k_len = _int(kv, f"{arch}.attention.key_length", path) or head_dim
    v_len = _int(kv, f"{arch}.attention.value_length", path) or k_len

    layer_bytes = [0] * n_layers
    # Expert tensors: a token reads expert_used_count of expert_count of each.
    experts = _int(kv, f"{arch}.expert_count", path) or 0
    used = min(_int(kv, f"{arch}.expert_used_count", path) or experts, experts)
    idle = [0] * n_layers  # bytes of the experts a token does not read, per layer
    embed_bytes = 0
    head_bytes = 0
    types: set[str] = set()
    n_params = 0
    for tname, (type_name, shape) in header.tensors.items():
        types.add(type_name)
        # GGUF shapes count elements, not the blocks a quantized type packs them in.
        n_params += math.prod(shape)
        nbytes = header.nbytes[tname]
        m = _BLK.match(tname)
        if m is not None:
            i = int(m.group(1))
            # Tensors past block_count (e.g. next-token-prediction layers) are not
            # loaded by llama.cpp as layers; leave them out of the layer sizes.
            if i < n_layers:
                layer_bytes[i] += nbytes
                if experts and _EXPERTS.search(tname):
                    idle[i] += nbytes * (experts - used) // experts
        elif tname in ("output.weight", "output_norm.weight", "output_norm.bias"):
            head_bytes += nbytes
        else:
            # token_embd.weight plus the small global tensors (rope_freqs, ...) that
            # every llama.cpp slice carries: count them where every stage pays them.
            embed_bytes += nbytes

    quant_types = sorted(types)
    encoder = embedding_only(arch, kv)
    engines = gguf_engines(header, path, encoder)

    return ModelFacts(
        name=name,
        sha256=sha256 if sha256 is not None else file_sha256(path, cache_dir),
        format="gguf",
        architecture=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        n_ctx_train=n_ctx_train,
        layer_bytes=layer_bytes,
        layer_active_bytes=[b - x for b, x in zip(layer_bytes, idle, strict=True)]
        if any(idle)
        else [],
        layer_state=layer_state(header.tensors, n_layers),
        embed_bytes=embed_bytes,
        head_bytes=head_bytes,
        kv_bytes_per_token_layer=n_head_kv * (k_len + v_len) * _KV_ELEMENT_BYTES,
        quant_types=quant_types,
        engines=engines,
        n_vocab=_n_vocab(header.tensors),
        vocab_hash=header.vocab_hash,
        sampling=gguf_sampling(kv),
        embedding_only=encoder,
        n_params=n_params,
    )


def layer_state(tensors: Mapping[str, object], n_layers: int) -> str:
    """``ModelFacts.layer_state`` from a GGUF's tensor names: per layer ``a`` (attention
    projections), ``r`` (recurrent state tensors), ``b`` (both), ``-`` (neither); "" when
    no layer is recurrent."""
    attn, rec = [False] * n_layers, [False] * n_layers
    for name in tensors:
        m = _BLK.match(name)
        if m is None or int(m.group(1)) >= n_layers:
            continue
        i = int(m.group(1))
        attn[i] = attn[i] or _ATTENTION.match(name) is not None
        rec[i] = rec[i] or _RECURRENT.match(name) is not None
    if not any(rec):
        return ""
    return "".join("-arb"[a + 2 * r] for a, r in zip(attn, rec, strict=True))


def gguf_engines(header: GgufHeader, path: Path, encoder: bool) -> list[str]:
    """The engines that can build the GGUF whose header is ``header``: those the rule
    offers for its architecture (:func:`~meshd.domain.builds.buildable_engines`), less
    MLX where the file holds what its GGUF path cannot build (a tensor type neither
    mx.load nor gguf-py reads, a layer tensor no llama layer has, an encoder)."""
    engines = buildable_engines("gguf", str(header.kv.get("general.architecture")))
    # MLX stages run decoders only.
    if "mlx" in engines and (encoder or not _mlx_builds(header, path)):
        engines.remove("mlx")
    return engines


def _mlx_builds(header: GgufHeader, path: Path) -> bool:
    """Whether the MLX stage's own check of a GGUF (the one it loads by) passes."""
    try:
        gguf_layout(header, path)
    except (UnsupportedModelError, ModelFormatError):
        return False
    return True


#: Encoder-only architectures llama.cpp runs: they embed, they do not generate.
ENCODER_ARCHITECTURES = frozenset(
    {"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert",
     "neo-bert", "t5encoder"}
)  # fmt: skip


def embedding_only(arch: str, kv: Mapping[str, Any]) -> bool:
    """Whether a GGUF of ``arch`` with metadata ``kv`` is an embedding model only: an
    encoder architecture, or attention its metadata says is not causal."""
    return arch in ENCODER_ARCHITECTURES or kv.get(f"{arch}.attention.causal") is False


def _n_vocab(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Rows of the token embedding (``ne[1]``): the token ids the model knows."""
    embd = tensors.get("token_embd.weight")
    return int(embd[1][1]) if embd is not None and len(embd[1]) > 1 else 0


def _int(kv: dict[str, Any], key: str, path: Path | str = "") -> int | None:
    v = kv.get(key)
    if v is None:
        return None
    # Some architectures store per-layer head counts as an array: size for the
    # largest layer so the KV estimate never comes out short.
    if isinstance(v, list) and v and all(isinstance(x, int | float) for x in v):
        v = max(v)
    if not isinstance(v, int | float) or not 0 <= v <= _MAX_COUNT:
        raise ModelFormatError(f"{path}: GGUF metadata {key!r} is {str(v)[:80]}, not a count")
    return int(v)


def _required_int(kv: dict[str, Any], key: str, path: Path) -> int:
    v = _int(kv, key, path)
    if v is None:
        raise ModelFormatError(f"{path}: GGUF metadata lacks {key!r}")
    return v

"""What a model is, as placement and the API read it from its file's header."""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from .sampling import SamplingChoice

__all__ = ["MaybeSha256", "ModelFacts", "Sha256", "is_sha256"]

_SHA256 = "[0-9a-f]{64}"
#: A content id as it crosses the wire: 64 lowercase hex digits. It names cache paths
#: (``<cache>/<sha256[:16]>/...``), so anything else ("../..", "/etc") must fail to
#: decode, never reach a path.
Sha256 = Annotated[str, msgspec.Meta(pattern=rf"\A{_SHA256}\Z")]
#: :data:`Sha256`, or "" where it is not known.
MaybeSha256 = Annotated[str, msgspec.Meta(pattern=rf"\A({_SHA256})?\Z")]
_SHA256_RE = re.compile(_SHA256)


def is_sha256(value: str) -> bool:
    """Whether ``value`` is a sha256 in hex (64 lowercase digits, nothing else)."""
    return _SHA256_RE.fullmatch(value) is not None


class ModelFacts(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What placement needs to know about a model, read once from its file.

    Stored in the instance, so every node computes the same plan and the same repair
    without holding the model file itself.
    """

    #: The name the model was asked for by (alias, path or repo id).
    name: str
    sha256: MaybeSha256
    #: ``gguf`` or ``mlx`` (a config.json + safetensors folder).
    format: str = "gguf"
    architecture: str = "llama"
    n_layers: int
    hidden_size: int
    #: Context length the model was trained for.
    n_ctx_train: int
    #: Bytes of each block's weights, in layer order (len == n_layers).
    layer_bytes: list[int]
    #: Bytes of each block a token reads (empty: all of :attr:`layer_bytes`). A
    #: mixture-of-experts block holds every expert but runs ``expert_used_count`` of its
    #: ``expert_count`` a token, beside its shared tensors: decode time follows these,
    #: memory and prefill time the whole block (see :meth:`active_layer_bytes`).
    layer_active_bytes: list[int] = []
    #: The state each layer keeps, one letter a layer, for a model with recurrent layers:
    #: ``a`` attention (a KV cache), ``r`` recurrent (an SSM, a short convolution, a
    #: linear attention), ``b`` both, ``-`` neither (an FFN alone); "" for a model of
    #: attention layers only. Each stage of a split holds a layer of each kind there is.
    layer_state: str = ""
    #: Token embedding bytes (every llama.cpp stage carries it).
    embed_bytes: int = 0
    #: Final norm + output head bytes (last stage; 0 when tied to the embedding).
    head_bytes: int = 0
    #: KV cache bytes per token per layer at the cache type used (K and V together).
    kv_bytes_per_token_layer: int = 0
    #: GGUF tensor types present, e.g. ``["F32", "Q4_1", "Q6_K"]``.
    quant_types: list[str] = []
    #: Engines that can run this model: ``llama_cpp``, ``mlx``.
    engines: list[str] = []
    #: Token ids the model can produce at most (its embedding rows; 0: unknown).
    n_vocab: int = 0
    #: The sampling its authors recommend, when they ship one.
    sampling: SamplingChoice | None = None
    #: An encoder (BERT-like): it serves embeddings, never a completion, on one node.
    embedding_only: bool = False
    #: Fingerprint of its token list (GGUF; "" unknown): a model with the same one
    #: can draft for it (see ``meshd.placement.drafts``).
    vocab_hash: str = ""
    #: Weights the model holds, each tensor's elements summed (0: not known).
    n_params: int = 0
    #: Bytes of its image projector (an ``mmproj*.gguf`` beside it; 0: it has none),
    #: which a llama.cpp stage 0 loads beside its layers.
    projector_bytes: int = 0

    def active_layer_bytes(self) -> list[int]:
        """Bytes a token reads of each block: :attr:`layer_active_bytes` where the
        facts give them (one per layer), else every block whole (a dense model)."""
        if len(self.layer_active_bytes) == len(self.layer_bytes):
            return list(self.layer_active_bytes)
        return list(self.layer_bytes)

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole model's weights: what memory and a prefill pay."""
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes

    @property
    def active_bytes(self) -> int:
        """Bytes of weights one decoded token reads: :attr:`total_bytes` less the
        experts a mixture-of-experts block does not run (equal for a dense model)."""
        return sum(self.active_layer_bytes()) + self.embed_bytes + self.head_bytes

    @property
    def parameter_size(self) -> str:
        """:attr:`n_params` as model cards write it, three figures at most (``135M``,
        ``1.71B``, ``70.6B``; "" when not known): Ollama's ``parameter_size``."""
        n = self.n_params
        for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
            if n >= scale:
                x = n / scale
                return f"{x:.0f}{unit}" if x >= 100 else f"{x:.{1 if x >= 10 else 2}f}{unit}"
        return str(n) if n else ""

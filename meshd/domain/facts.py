"""What a model is, as placement and the API read it from its file's header."""

from __future__ import annotations

import msgspec

from .sampling import SamplingChoice

__all__ = ["ModelFacts"]


class ModelFacts(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What placement needs to know about a model, read once from its file.

    Stored in the instance, so every node computes the same plan and the same repair
    without holding the model file itself.
    """

    #: The name the model was asked for by (alias, path or repo id).
    name: str
    sha256: str
    #: ``gguf`` or ``mlx`` (a config.json + safetensors folder).
    format: str = "gguf"
    architecture: str = "llama"
    n_layers: int
    hidden_size: int
    #: Context length the model was trained for.
    n_ctx_train: int
    #: Bytes of each block's weights, in layer order (len == n_layers).
    layer_bytes: list[int]
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

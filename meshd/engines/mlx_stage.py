"""One pipeline stage on MLX: a layer range of a decoder model, in-process, loaded from
a llama GGUF or from an MLX / Hugging Face model folder of an architecture mlx-lm
builds (llama, mistral, qwen2, qwen3, gemma3_text, gemma3's text model, phi3).

The counterpart of :mod:`meshd.engines.llama_stage` with the same contract
(:class:`~meshd.engines.llama_stage.StageInput` in, float32 hidden rows or logits out,
the same errors), so a pipeline may mix the two engines: stages exchange float32
residual-stream rows at the same absolute positions whichever engine ran them.

- Weights: where every tensor type is one ``mx.load`` reads right (F32/F16/BF16,
  Q4_0, Q4_1, Q8_0, Q6_K), ``mx.load`` reads the whole GGUF; Q4_0, Q4_1 and Q8_0
  tensors arrive as MLX affine-quantized weights (group 32), Q6_K as f16, F32/F16/BF16
  as they are. The stage keeps only what it needs (its layers; the embedding on a
  first stage; the final norm and the output head, or the tied embedding, on a last
  stage) and drops the rest. ``mx.load`` reads GGUF tensors eagerly, so while a stage
  loads, the whole file is in memory once (measured: +108 MB for the 98 MB default
  model, back to its share once the rest is dropped). A file with any other type
  (K-quants: Q4_K loads with wrong values in ``mx.load``, Q3_K, Q5_0, IQ4_NL... not
  at all) is read by :func:`meshd.models.gguf_dequant.load_tensors` instead:
  memory-mapped, only the stage's own tensors; Q4_K, Q5_K, Q4_0/1, Q5_0/1 and Q8_0
  repacked exactly into MLX affine groups of 32, Q6_K re-quantized to 8 bits and
  Q3_K, Q2_K, IQ* to 6 bits (measured errors in that module and in
  ``tests/engines/test_mlx_kquants.py``). Types neither reads are refused from the
  header, before anything is loaded (:class:`UnsupportedQuantError`).
- Model: mlx-lm's llama ``Model`` built with ``end - start`` layers and
  ``rope_traditional=True`` (GGUF stores Q/K rows permuted for llama.cpp's rope).
  On the CPU the quantization scales and biases are cast to float32: MLX's CPU
  quantized matmul is ~1000x slower with f16 scales, and f32 keeps the residual
  stream in f32 like llama.cpp's exact mode.
- Requests: one mlx-lm ``KVCache`` per layer per request (``seq``), for sliding-window
  layers too (their window is a mask: a ``RotatingKVCache`` overwrites positions that
  ``truncate`` and ``share`` need). On a llama, mistral, qwen2, qwen3, phi3 or
  Gemma 3 model, windowed layers included (``MlxStage.batched``), a forward call
  batches its items ragged: the token-wise work (norms, projections, MLP, head) runs
  once on the rows of every item concatenated, and only attention (rope offset,
  cache, causal or window mask) runs per item (it saves nothing on MLX's CPU, whose
  quantized matmul costs the same per row; on Metal it shares each weight read).
  Any other block would run through its own ``__call__`` one item at a time.
- Tokenizer: the GGUF's own vocabulary through llama.cpp (``vocab_only``), so token
  ids and pieces are the ones the llama.cpp stages use.
- Folders (``config.json`` + ``*.safetensors``, see :mod:`meshd.models.folder`):
  ``model_type`` llama, mistral, qwen2, qwen3, gemma3_text, gemma3 (its text model)
  or phi3, unquantized or MLX-quantized (config.json's ``quantization``, bits and
  group size per module as mlx-lm infers them). The model is mlx-lm's own for that
  type (``mlx_lm.utils._get_classes``, as ``mlx_lm.load`` picks it), built with the
  whole model's layer count so every layer is made at its own index (Gemma 3's
  sliding pattern and rope per layer kind; a folder slice says where it starts),
  then cut to the stage's layers; the others are lazy parameters never evaluated
  (measured: a 2-of-16-layer stage adds exactly its 2 layers' bytes). The stage
  runs that model's own embedding (with Gemma's sqrt(hidden) scale, on token
  embeddings only), its layers (the ragged block, or their ``__call__`` with
  mlx-lm's mask) with each layer's window (from the model's ``make_cache()``: a
  rotating cache marks a sliding layer and its window), its final norm and head, its
  ``sanitize`` (ties). Within ~3e-5 of mlx-lm's whole model in logits (0 for llama,
  mistral, qwen2, qwen3, phi3).
  ``mx.load`` maps safetensors lazily, so a stage reads only its own
  tensors. Tokenizer: the folder's ``tokenizer.json`` through
  :class:`~meshd.models.vocab.HfVocab` (llama.cpp's rules for pieces and stop ids).
  A folder written from a GGUF (:func:`~meshd.models.convert.gguf_to_mlx_folder`)
  gives the GGUF stage's greedy tokens, logits within ~1e-4.

A stage is not thread-safe: a runner calls it from one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import numpy.typing as npt

from meshd.models.errors import ModelFormatError, UnsupportedModelError
from meshd.models.mlx_layout import (
    GGUF_GROUP_SIZE,
    GgufLayout,
    folder_name,
    inspect_gguf,
    layer_shift,
    mlx_name,
)
from meshd.models.vocab import HfVocab

from . import mlx_lm_light
from .llama_stage import LlamaVocab
from .mlx_ragged import ragged_block, ragged_model
from .stage import (
    StageError,
    StageInput,
    StageInputError,
    StageOutput,
    check_seq,
    stage_role,
    validate_embed_inputs,
    validate_inputs,
)

if TYPE_CHECKING:
    from meshd.models.folder import FolderModel

__all__ = ["MlxStage"]

log = logging.getLogger("meshd.engines.mlx")


class _FactorRoPE:
    """Rope with per-dimension frequency factors (GGUF ``rope_freqs.weight``).

    llama.cpp divides each rotation frequency by its factor; MLX's ``freqs`` are
    periods, so they are the base periods multiplied by the factors.
    """

    def __init__(self, dims: int, base: float, scale: float, factors: Any) -> None:
        import mlx.core as mx

        self.dims = dims
        self.scale = scale
        periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        self.freqs = periods * factors.astype(mx.float32)

    def __call__(self, x: Any, offset: int = 0) -> Any:
        import mlx.core as mx

        return mx.fast.rope(
            x,
            self.dims,
            traditional=True,
            base=None,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )


# -- the stage ---------------------------------------------------------------------


class MlxStage:
    """Layers ``[start, end)`` of a decoder model, run with MLX in-process.

    ``path`` is the whole model's GGUF (not a slice) or its MLX / Hugging Face folder
    (``config.json`` + ``*.safetensors``). ``first``: the stage takes token
    ids (requires ``start == 0``), else hidden rows. ``last``: the stage returns
    logits (requires ``end`` = the model's layer count), else hidden rows.

    ``n_ctx`` is the context each sequence gets; ``n_seq_max`` how many sequences
    (requests) the stage holds at once, with ids ``0 .. n_seq_max - 1``. Caches grow
    as requests grow (mlx-lm allocates K/V in steps of 256 positions), they are not
    reserved up front.

    ``exact`` keeps every weight scale and the activations in float32 on any device;
    on the CPU that is always the case (f16 scales are ~1000x slower there). On a
    GPU the default keeps the scales as loaded (f16) for speed.

    ``n_batch`` is the most rows one evaluation takes; longer inputs (prefills) are
    run in chunks in order, which bounds the attention's memory.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        start: int,
        end: int,
        first: bool,
        last: bool,
        n_ctx: int,
        n_seq_max: int,
        exact: bool = False,
        n_batch: int = 512,
    ) -> None:
        path = Path(path)
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max must be positive, got {n_seq_max}")
        if n_batch < 1:
            raise ValueError(f"n_batch must be positive, got {n_batch}")
        spec: GgufLayout | FolderModel
        if path.is_dir():
            from meshd.models.folder import inspect_folder

            # config.json and the safetensors headers only: refuses an unusable folder
            # before any tensor is read.
            spec = inspect_folder(path)
        else:
            # Header only: refuses an unusable file before mx.load reads any tensor.
            spec = inspect_gguf(path)
        if not 0 <= start < end <= spec.n_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's {spec.n_layers}")
        if first and start != 0:
            raise ValueError(f"a first stage starts at layer 0, not {start}")
        if last and end != spec.n_layers:
            raise ValueError(f"a last stage ends at layer {spec.n_layers}, not {end}")

        mx = self._mx = mlx_lm_light.mlx_core()  # mlx-lm's models, not its tokenizers
        self.path = path
        self.start = start
        self.end = end
        self.first = first
        self.last = last
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        self.exact = exact
        #: Number of layers this stage runs (``end - start``), like a slice's count.
        self.n_layers = end - start
        #: Width of the residual stream: the hidden rows a stage takes and returns.
        self.hidden_size = spec.hidden_size
        #: Context the model was trained for (0 = the model does not say).
        self.n_ctx_train = (
            spec.context_length or 0 if isinstance(spec, GgufLayout) else spec.n_ctx_train
        )
        self._caches: dict[int, list[Any]] = {}
        self._vocab: LlamaVocab | HfVocab | None
        if isinstance(spec, GgufLayout):
            self._vocab = LlamaVocab.load(path)
            #: Vocabulary size: the tokenizer's, and the rows of the embedding and the
            #: output head (a folder's model may pad them past its tokenizer's ids).
            self.n_vocab = self._vocab.n_vocab
        else:
            self._vocab = HfVocab.load(path)
            self.n_vocab = spec.vocab_rows
        for role, rows in (("embedding", spec.embed_rows), ("output head", spec.vocab_rows)):
            if not (first if role == "embedding" else last):
                continue
            n_tokens = self._vocab.n_vocab
            if rows != self.n_vocab or rows < n_tokens:
                self.close()
                raise ModelFormatError(
                    f"{path}: {role} has {rows} rows for a vocabulary of {n_tokens}"
                )
        t0 = time.perf_counter()
        try:
            self._load(spec)
        except BaseException:
            self.close()
            raise
        log.info("loaded %r in %.2f s on %s", self, time.perf_counter() - t0, mx.default_device())

    # -- loading -------------------------------------------------------------------

    def _load(self, spec: GgufLayout | FolderModel) -> None:
        if isinstance(spec, GgufLayout):
            self._load_gguf(spec)
        else:
            self._load_folder(spec)
        self._KVCache = _kv_cache_class()

    def _holds(self, target: str | None, want_embed: bool) -> TypeGuard[str]:
        """Whether this stage loads the tensor named ``target`` (mlx-lm's name; None
        for a layer outside the stage): the embedding only where it is used, the final
        norm and the head only on the last stage."""
        if target is None:
            return False
        if target.startswith("model.embed_tokens."):
            return want_embed
        if target.startswith(("model.norm.", "lm_head.")):
            return self.last
        return True

    def _load_gguf(self, spec: GgufLayout) -> None:
        from mlx_lm.models.llama import ModelArgs

        mx = self._mx
        f32_scales = self.exact or mx.default_device() == mx.cpu
        want_embed = self.first or (self.last and spec.tied)
        if spec.mx_loadable:
            # The header was read already (read_header): the metadata is not needed.
            raw = mx.load(str(self.path))
        else:
            # mx.load reads some of this file's types wrong (Q4_K) or not at all
            # (Q3_K, IQ4_NL...): gguf-py reads this stage's own tensors, memory-mapped.
            from meshd.models.gguf_dequant import load_tensors

            raw = load_tensors(
                self.path,
                lambda n: (
                    n == "rope_freqs.weight"
                    or self._holds(mlx_name(n, self.start, self.end), want_embed)
                ),
            )
        weights: dict[str, Any] = {}
        rope_factors = raw.get("rope_freqs.weight")
        for name in list(raw):
            arr = raw.pop(name)  # drop our reference as we go: unused tensors are freed
            target = mlx_name(name, self.start, self.end)
            if not self._holds(target, want_embed):
                continue
            if target.endswith((".scales", ".biases")) and f32_scales:
                arr = arr.astype(mx.float32)
            weights[target] = arr
        del raw

        args = ModelArgs(
            model_type="llama",
            hidden_size=spec.hidden_size,
            num_hidden_layers=self.n_layers,
            intermediate_size=spec.intermediate_size,
            num_attention_heads=spec.n_heads,
            num_key_value_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=spec.rms_norm_eps,
            vocab_size=spec.vocab_rows,
            max_position_embeddings=spec.context_length,
            rope_theta=spec.rope_theta,
            rope_traditional=True,
            rope_scaling=(
                {"type": "linear", "factor": spec.rope_scale} if spec.rope_scale != 1.0 else None
            ),
            attention_bias=spec.attention_bias,
            mlp_bias=spec.mlp_bias,
            tie_word_embeddings=spec.tied,
        )
        # Quantized modules get their bits from the packed width of their weight:
        # bits = 32 * packed_cols / (scale_cols * group) = packed_cols / scale_cols.
        qbits: dict[str, int] = {}
        for k, v in weights.items():
            if k.endswith(".scales"):
                mod = k[: -len(".scales")]
                packed = weights.get(f"{mod}.weight")
                if packed is None or v.shape[-1] == 0 or packed.shape[-1] % v.shape[-1]:
                    raise ModelFormatError(f"{self.path}: bad quantized tensor {mod}")
                qbits[mod] = packed.shape[-1] // v.shape[-1]

        def quantized(p: str, _m: Any) -> bool | dict[str, Any]:
            bits = qbits.get(p)
            if bits is None:
                return False
            return {"group_size": GGUF_GROUP_SIZE, "bits": bits, "mode": "affine"}

        model = self._assemble(args, weights, quantized, tied=spec.tied)

        if spec.has_rope_freqs:
            if rope_factors is None:
                raise ModelFormatError(f"{self.path}: rope_freqs.weight did not load")
            rope = _FactorRoPE(spec.head_dim, spec.rope_theta, 1.0 / spec.rope_scale, rope_factors)
            mx.eval(rope.freqs)
            for layer in model.model.layers:
                layer.self_attn.rope = rope

    def _load_folder(self, spec: FolderModel) -> None:
        """Gather this stage's tensors of an MLX / Hugging Face folder and build it.

        ``mx.load`` maps safetensors lazily: only the tensors kept here are ever read,
        so a stage holds its share of the model, never the whole of it.

        The model is mlx-lm's own for the folder's ``model_type`` (as ``mlx_lm.load``
        picks it), built with the whole model's layer count so that every layer is
        made at its own index (Gemma 3's sliding-window pattern, rope per layer kind);
        only the stage's layers are kept (see :meth:`_assemble`).
        """
        from mlx_lm.utils import _get_classes

        mx = self._mx
        f32_scales = self.exact or mx.default_device() == mx.cpu
        want_embed = self.first or (self.last and spec.tied)
        per_file: dict[Path, dict[str, str]] = {}
        for name, (file, _dtype, _shape, _n) in spec.tensors.items():
            target = folder_name(name, self.start, self.end)
            if not self._holds(target, want_embed):
                continue
            if target.startswith("lm_head.") and spec.tied:
                continue  # a tied head is the embedding (mlx-lm drops it too)
            per_file.setdefault(file, {})[name] = target
        weights: dict[str, Any] = {}
        for file, names in per_file.items():
            arrays = mx.load(str(file))
            for name, target in names.items():
                arr = arrays[spec.prefix + name]
                if (
                    f32_scales
                    and target.endswith((".scales", ".biases"))
                    and arr.dtype in (mx.float16, mx.bfloat16)
                ):
                    arr = arr.astype(mx.float32)
                weights[target] = arr
            del arrays

        # Layer start + i of this folder is layer first + i of the whole model (a
        # folder slice starts past the whole model's layer 0).
        first = spec.layer_offset + self.start
        total = spec.layer_offset + spec.n_layers
        config = dict(spec.config)
        config.update(
            num_hidden_layers=total,
            vocab_size=spec.embed_rows,
            tie_word_embeddings=spec.tied,
        )
        types = spec.config.get("layer_types")
        if spec.layer_offset and isinstance(types, list) and len(types) == spec.n_layers:
            # A slice's per-layer list holds its own layers only: pad it in front for
            # the whole model's layers it does not hold (they are never loaded).
            config["layer_types"] = types[:1] * spec.layer_offset + types
        if spec.model_type in ("llama", "mistral"):
            config["rope_traditional"] = spec.rope_traditional
        model_class, args_class = _get_classes(config)
        args = args_class.from_dict(config)
        quant = spec.quantization or {}
        start = self.start

        def quantized(p: str, m: Any) -> bool | dict[str, Any]:
            scales = weights.get(f"{p}.scales")
            packed = weights.get(f"{p}.weight")
            if scales is None or packed is None or not hasattr(m, "to_quantized"):
                return False
            # Per-module entries of config.json name the model's own layer numbers.
            over = quant.get(spec.prefix + layer_shift(p, start))
            params = over if isinstance(over, dict) else quant
            in_dims = int(m.weight.shape[-1])
            if scales.shape[-1] == 0 or in_dims % scales.shape[-1]:
                raise ModelFormatError(f"{self.path}: bad quantized tensor {p}")
            # As mlx-lm infers them: the group from the scales' width, the bits from
            # the packed width (right even where config.json's default is not).
            return {
                "group_size": in_dims // int(scales.shape[-1]),
                "bits": int(packed.shape[-1]) * 32 // in_dims,
                "mode": str(params.get("mode", "affine")),
            }

        self._assemble(
            args, weights, quantized, tied=spec.tied, model_class=model_class, first=first
        )

    def _assemble(
        self,
        args: Any,
        weights: dict[str, Any],
        quantized: Any,
        *,
        tied: bool,
        model_class: Any = None,
        first: int | None = None,
    ) -> Any:
        """mlx-lm's ``model_class`` (its llama ``Model`` by default, built with
        ``args``) with ``weights`` (this stage's tensors, named as in the stage's
        model) loaded into it; sets the stage's modules.

        ``first``: the whole model's index of the stage's first layer when ``args``
        counts the whole model's layers; the stage keeps ``end - start`` layers from
        there (renumbered from 0) and drops the others before any is loaded. None:
        ``args`` counts the stage's layers only.
        """
        import mlx.nn as nn
        from mlx.utils import tree_flatten

        if model_class is None:
            from mlx_lm.models.llama import Model as model_class

        mx = self._mx
        want_embed = self.first or (self.last and tied)
        # Parameters are created lazily: modules this stage never loads or runs (the
        # embedding of a middle stage, the layers of other stages) never allocate
        # memory, they are graphs of random initializers that are never evaluated.
        model = model_class(args)
        inner = model.model
        lo = 0 if first is None else first
        # Each layer's attention window (None: full), read off the model's own cache
        # list before its layers are cut to the stage's.
        self._windows = _layer_windows(model, len(inner.layers))[lo : lo + self.n_layers]
        inner.layers = inner.layers[lo : lo + self.n_layers]
        # The model's own renaming and tying (Gemma 3 drops its lm_head when the
        # checkpoint has none), as mlx_lm.load applies it, before quantizing.
        if hasattr(model, "sanitize"):
            weights = model.sanitize(weights)
        nn.quantize(model, class_predicate=quantized)

        params = dict(tree_flatten(model.parameters()))
        for k, v in weights.items():
            have = params.get(k)
            if have is None:
                raise ModelFormatError(f"{self.path}: tensor for {k} has no place in the model")
            if tuple(have.shape) != tuple(v.shape):
                raise ModelFormatError(
                    f"{self.path}: {k} has shape {tuple(v.shape)}, the model wants "
                    f"{tuple(have.shape)}"
                )
        prefixes = ["model.layers."]
        if want_embed:
            prefixes.append("model.embed_tokens.")
        if self.last:
            prefixes.append("model.norm.")
            if not tied:
                prefixes.append("lm_head.")
        missing = sorted(k for k in params if k.startswith(tuple(prefixes)) and k not in weights)
        if missing:
            raise ModelFormatError(f"{self.path}: no tensor for {', '.join(missing[:5])}")
        model.load_weights(list(weights.items()), strict=False)
        mx.eval(list(weights.values()))

        self._model = model
        self._layers = list(inner.layers)
        self._embed = inner.embed_tokens if self.first else None
        self._embed_scale = _embed_scale(model) if self.first else None
        # Requests batched ragged where meshd.engines.mlx_ragged has the block.
        self.batched = ragged_model(model)
        if self.last:
            self._norm = inner.norm
            # A tied head is the embedding used as a linear layer.
            self._head = inner.embed_tokens.as_linear if tied else model.lm_head
        return model

    @property
    def mlx_model(self) -> Any:
        """The mlx-lm ``Model`` (of the folder's ``model_type``; llama for a GGUF)
        holding this stage's layers (``end - start`` of them, numbered from 0) and,
        where the stage uses them, the embedding, final norm and head."""
        self._check_open()
        return self._model

    # -- requests ------------------------------------------------------------------

    def n_past(self, seq: int) -> int:
        """Positions the stage holds for ``seq`` (the next input's ``pos``)."""
        self._check_open()
        caches = self._caches.get(seq)
        return 0 if caches is None else int(caches[0].offset)

    def free(self, seq: int) -> None:
        """Release a request's KV cache; its seq id can start a new request at pos 0."""
        self._check_open()
        self._check_seq(seq)
        self._caches.pop(seq, None)

    def share(self, src: int, dst: int, n: int) -> None:
        """Make the empty ``dst`` hold ``src``'s first ``n`` positions (their K/V rows
        copied into caches of its own)."""
        self._check_open()
        self._check_seq(src)
        self._check_seq(dst)
        if self.n_past(dst) != 0 or self.n_past(src) < n:
            raise StageInputError(f"cannot share {n} positions of seq {src} with seq {dst}")
        caches = []
        for c in self._caches[src]:
            d = self._KVCache()
            d.update_and_fetch(c.keys[..., :n, :], c.values[..., :n, :])
            caches.append(d)
        self._mx.eval([x for d in caches for x in (d.keys, d.values)])
        self._caches[dst] = caches

    def truncate(self, seq: int, n: int) -> None:
        """Keep only ``seq``'s first ``n`` positions (the rows past them are written
        over as the sequence grows again)."""
        self._check_open()
        self._check_seq(seq)
        past = self.n_past(seq)
        if not 0 <= n <= past:
            raise StageInputError(f"cannot keep {n} positions of seq {seq}")
        for c in self._caches.get(seq, []):
            c.trim(past - n)

    def _check_open(self) -> None:
        if self._vocab is None:
            raise StageError("stage is closed")

    def _check_seq(self, seq: int) -> None:
        check_seq(seq, self.n_seq_max)

    def _validate(self, items: Sequence[StageInput]) -> list[np.ndarray]:
        return validate_inputs(self, items)

    def forward(self, items: Sequence[StageInput]) -> list[StageOutput]:
        """Run this stage's layers on several requests at once; outputs in item order.

        Each output is a float32 array: hidden rows ``(n, hidden_size)`` (the residual
        stream after the stage's last layer) on a stage that is not last, the last
        row's logits ``(n_vocab,)`` on the last one.

        Where :attr:`batched` (llama, mistral, qwen2, qwen3, phi3, Gemma 3 blocks) the
        rows of all items run together (ragged batch: attention per item, all other
        work on the concatenated rows, :mod:`meshd.engines.mlx_ragged`); other models
        run each item through the layers on its own. Either way in chunks of at most
        ``n_batch`` rows.
        Raises StageInputError (before running anything) for an item that does not
        fit; if MLX fails, every item's sequence is rolled back to its ``pos``.
        """
        self._check_open()
        if not items:
            return []
        inputs = self._validate(items)
        mx = self._mx
        lengths = [len(a) for a in inputs]
        ends = np.cumsum(lengths)
        starts = ends - lengths
        total = int(ends[-1])
        flat = np.concatenate(inputs) if len(inputs) > 1 else inputs[0]
        caches = [self._cache(it.seq) for it in items]

        out_rows: list[Any] = []  # per chunk: hidden rows (non-last) or logits rows
        # (chunk, row) of each of an item's logits rows, by item.
        logits_of: list[list[tuple[int, int]]] = [[] for _ in items]
        try:
            for c0 in range(0, total, self.n_batch):
                c1 = min(total, c0 + self.n_batch)
                spans: list[tuple[int, int, list[Any]]] = []
                last_rows: list[int] = []
                for k, it in enumerate(items):
                    s, e = max(int(starts[k]), c0), min(int(ends[k]), c1)
                    if s < e:
                        spans.append((s - c0, e - c0, caches[k]))
                        for r in range(max(s, int(ends[k]) - it.n_logits), e):
                            logits_of[k].append((len(out_rows), len(last_rows)))
                            last_rows.append(r - c0)
                y = self._run(flat[c0:c1], spans, last_rows)
                # One evaluation per chunk: the next chunk reads these K/V entries.
                mx.eval(y)
                out_rows.append(y)
        except BaseException:
            for it, cache in zip(items, caches, strict=True):
                for c in cache:
                    c.trim(c.offset - it.pos)
            raise

        if self.last:
            wanted = {ci for rows in logits_of for ci, _ in rows}
            chunks = {ci: np.array(out_rows[ci], dtype=np.float32) for ci in wanted}
            out = [np.stack([chunks[ci][ri] for ci, ri in rows]) for rows in logits_of]
            return [x[0] if len(x) == 1 else x for x in out]
        hidden = np.concatenate([np.array(y, dtype=np.float32) for y in out_rows])
        # Views of one array made for this call: nothing else ever writes to it.
        return [hidden[s:e] for s, e in zip(starts, ends, strict=True)]

    #: MLX stages run decoder models only, none with recurrent layers.
    generative, recurrent = True, False
    #: Each sequence has caches of its own: a kept one costs memory, not time.
    kept_rows = None

    def embed(self, items: Sequence[StageInput]) -> list[npt.NDArray[np.float32]]:
        """For each item, the final hidden states (after the output norm) of every row
        of its input, ``(n, hidden_size)``, run together on caches of their own that are
        dropped after (see :meth:`Stage.embed`)."""
        self._check_open()
        inputs = validate_embed_inputs(self, items)
        assert self._norm is not None
        mx = self._mx
        lengths = [len(a) for a in inputs]
        ends = np.cumsum(lengths)
        starts = ends - lengths
        total = int(ends[-1])
        flat = np.concatenate(inputs) if len(inputs) > 1 else inputs[0]
        caches = [[self._KVCache() for _ in self._layers] for _ in inputs]
        chunks = []
        for c0 in range(0, total, self.n_batch):
            c1 = min(total, c0 + self.n_batch)
            spans = [
                (max(int(s), c0) - c0, min(int(e), c1) - c0, cache)
                for s, e, cache in zip(starts, ends, caches, strict=True)
                if max(int(s), c0) < min(int(e), c1)
            ]
            y = self._norm(self._run(flat[c0:c1], spans, []))
            mx.eval(y)
            chunks.append(np.array(y, dtype=np.float32))
        rows = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
        return [rows[s:e] for s, e in zip(starts, ends, strict=True)]

    def _cache(self, seq: int) -> list[Any]:
        caches = self._caches.get(seq)
        if caches is None:
            caches = self._caches[seq] = [self._KVCache() for _ in self._layers]
        return caches

    def _run(
        self, x: np.ndarray, spans: list[tuple[int, int, list[Any]]], last_rows: list[int]
    ) -> Any:
        """The lazy graph of one chunk: rows ``x`` through every layer (and the head)."""
        mx = self._mx
        if self.first:
            assert self._embed is not None
            h = self._embed(mx.array(x))
            if self._embed_scale is not None:
                # In the embedding's dtype, as the model's own __call__ scales it;
                # only token embeddings: hidden rows from a stage before are not.
                h = h * self._embed_scale.astype(h.dtype)
            h = h.astype(mx.float32)[None]
        else:
            h = mx.array(x)[None]
        if self.batched:
            for i, (layer, w) in enumerate(zip(self._layers, self._windows, strict=True)):
                h = ragged_block(layer, h, [(s, e, c[i]) for s, e, c in spans], w)
        else:
            h = self._items(h, spans)
        if not self.last or not last_rows:
            # A last stage's chunk where no request ends (a long prefill cut into
            # chunks) has no logits to give; evaluating h fills the caches.
            return h[0]
        rows = self._norm(h[0][mx.array(np.asarray(last_rows, np.int32))])
        return self._head(rows)

    def _items(self, h: Any, spans: list[tuple[int, int, list[Any]]]) -> Any:
        """Every layer's own ``__call__`` on the rows of one request at a time (its
        own caches), with mlx-lm's mask for each layer's kind: causal over the whole
        cache for full attention, causal within the window for sliding layers."""
        from mlx_lm.models.base import create_attention_mask

        mx = self._mx
        outs = []
        for s, e, caches in spans:
            x = h[:, s:e]
            # One mask per window size: every layer of a request holds the same
            # positions, so the first layer's cache stands for all of them.
            masks = {
                w: create_attention_mask(x, caches[0], window_size=w) for w in set(self._windows)
            }
            for layer, cache, w in zip(self._layers, caches, self._windows, strict=True):
                x = layer(x, masks[w], cache)
            outs.append(x)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)

    # -- tokenizer -----------------------------------------------------------------

    def _vocab_open(self) -> LlamaVocab | HfVocab:
        if self._vocab is None:
            raise StageError("stage is closed")
        return self._vocab

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS/EOS as the model asks,
        ``parse_special`` turns special-token text (``<|im_start|>``) into its id."""
        return self._vocab_open().tokenize(text, add_special, parse_special)

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token (possibly part of a UTF-8 character).

        ``special`` renders control tokens (``<|im_end|>``) as their text; by default
        they render as nothing, which is what a chat reply shows.
        """
        return self._vocab_open().token_to_piece(token, special)

    def eos_tokens(self) -> set[int]:
        """Ids that end a generation: eos, eot and every end-of-generation token."""
        return self._vocab_open().eos_tokens()

    def special_texts(self) -> tuple[str, str]:
        """The BOS and EOS token texts chat templates get ("" when the model has none)."""
        v = self._vocab_open()
        return v.bos_token or "", v.eos_token or ""

    # -- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Drop the weights, the caches and the vocabulary. Safe to call twice."""
        self._caches = {}
        self._model = None
        self._layers = []
        self._embed = None
        self._embed_scale = None
        self._windows = []
        self._norm = None
        self._head = None
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None

    def __enter__(self) -> MlxStage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = stage_role(self.first, self.last)
        return (
            f"MlxStage({self.path.name}, {role}, layers=[{self.start}, {self.end}), "
            f"n_ctx={self.n_ctx}, n_seq_max={self.n_seq_max})"
        )


def _layer_windows(model: Any, n_layers: int) -> list[int | None]:
    """Each layer's attention window (None: the whole context), from the model's own
    ``make_cache()``: mlx-lm gives a sliding layer a ``RotatingKVCache`` of the
    window's size (Gemma 3's pattern, llama's ``layer_types``).

    The stage itself keeps a plain ``KVCache`` for every layer and masks the window
    instead: a rotating cache writes over positions past the window, so it could
    not be truncated back (speculation's rollback, prefix reuse) or shared.
    """
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if not hasattr(model, "make_cache"):
        return [None] * n_layers
    windows: list[int | None] = []
    for c in model.make_cache():
        if isinstance(c, RotatingKVCache) and c.keep == 0 and c.max_size:
            windows.append(int(c.max_size))
        elif type(c) is KVCache:
            windows.append(None)
        else:
            raise UnsupportedModelError(
                f"{type(model).__module__}: layer cache {type(c).__name__} is not supported "
                "by the MLX engine"
            )
    if len(windows) != n_layers:
        raise ModelFormatError(
            f"{type(model).__module__}: {len(windows)} caches for {n_layers} layers"
        )
    return windows


def _embed_scale(model: Any) -> Any | None:
    """The factor a model's own ``__call__`` multiplies token embeddings by, where it
    has one (Gemma's sqrt(hidden_size), rounded to bfloat16 as mlx-lm does); None."""
    import mlx.core as mx

    if type(model).__module__ == "mlx_lm.models.gemma3_text":
        return mx.array(model.args.hidden_size**0.5, mx.bfloat16)
    return None


def _kv_cache_class() -> Any:
    from mlx_lm.models.cache import KVCache

    return KVCache

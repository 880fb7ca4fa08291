"""One pipeline stage on llama.cpp: the layers of one GGUF slice, in-process.

A stage is built on the low-level llama.cpp API of stock llama-cpp-python (no patch,
no RPC build). The file it loads is a slice cut by :mod:`meshd.models.slicing` (or
the whole model for a one-stage pipeline):

- The first stage takes token ids; the others take hidden rows through
  ``batch.embd`` (float32, one row per token, at the token's absolute position).
- A stage that is not last returns the residual stream after its last layer. llama.cpp
  has no API for it (``llama_get_embeddings`` is taken after the final norm), so the
  scheduler's ``cb_eval`` callback copies the graph node ``l_out-{n_layer-1}`` out and
  cancels the rest of the graph (final norm and lm_head, which such a stage does not
  need anyway).
- The last stage returns the logits of each request's last row.

Every request is one llama.cpp sequence (``seq_id``) with its own KV cache; all the
requests handed to :meth:`LlamaStage.forward` go through one ``llama_decode`` call, so
several requests in flight share each weight read.

A stage is not thread-safe: a runner calls it from one thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from meshd.models.facts import embedding_only
from meshd.models.gguf import check_gguf_file, read_metadata
from meshd.models.scaling import input_scale

from . import attention
from .llama_backend import LlamaVocab, _get_backend
from .projector import Projector
from .stage import (
    ContextFullError,
    StageError,
    StageInput,
    StageInputError,
    StageOutput,
    check_seq,
    stage_role,
    validate_embed_inputs,
    validate_inputs,
)
from .threads import default_threads

__all__ = ["LlamaStage", "LlamaVocab", "_get_backend"]

log = logging.getLogger("meshd.engines.llama")


#: Most bytes of attention scores one decode call may hold with plain attention (see
#: meshd.engines.attention): llama.cpp reserves rows x cells x heads f32 for them, 646
#: MiB against flash attention's 98 for the default model at 512 rows x 32,768 cells.
#: A prefill hardly minds fewer rows a call: 3.3-3.5 ms a token from 64 to 512.
PLAIN_ATTENTION_BYTES = 128 * 2**20
#: Fewest rows a call may take whatever that budget says (a speculative step's rows
#: and a decode step of many requests should stay one call).
MIN_BATCH = 32

#: KV cache types a stage may keep (``InstanceSpec.kv_cache``) -> llama.cpp's ggml type.
KV_CACHE_GGML = {"f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0"}


def _one_token(it: StageInput) -> bool:
    """One token in, its logits out: a plain decode step."""
    t = it.tokens
    return (
        t is not None
        and it.hidden is None
        and it.n_logits == 1
        and t.ndim == 1
        and len(t) == 1
        and t.dtype.kind in "iu"
    )


class LlamaStage:
    """Layers of one GGUF slice, run with llama.cpp's low-level API in this process.

    ``first``: the stage takes token ids (else hidden rows). ``last``: the stage
    returns logits (else hidden rows). A one-stage pipeline is ``first=last=True``.

    ``n_ctx`` is the context each sequence gets; ``n_seq_max`` how many sequences
    (requests) the stage holds at once, with ids ``0 .. n_seq_max - 1``. The KV
    cache is one buffer shared by all sequences (llama.cpp's ``kv_unified``) of
    ``n_ctx * n_seq_max`` cells (llama.cpp rounds it up to 256), and the stage
    refuses any request that would pass ``n_ctx`` positions, so every sequence can
    always grow to ``n_ctx`` whatever the others hold. (Without ``kv_unified`` this
    llama.cpp splits ``n_ctx`` into ``n_ctx / n_seq_max`` per sequence, and it also
    reorders the rows of a multi-sequence batch, which the hidden-row capture relies
    on not happening.)

    ``exact=True`` turns flash attention off and keeps K/V in F32, to match an f32
    reference to ~1e-7; the default keeps llama.cpp's fast defaults (flash attention
    where supported, F16 K/V; ~5e-3 drift in logits). ``kv_cache`` ``q8_0`` or
    ``q4_0`` keeps K/V quantized (about 0.53x and 0.28x the bytes of F16), with flash
    attention on.

    ``n_batch`` is the most rows one ``llama_decode`` call takes; larger inputs are
    split into several calls in order. A stage that is not last marks every row as an
    output (or llama.cpp would drop them before the last layer), so llama.cpp sizes
    an output buffer of ``n_batch * n_vocab`` floats it never fills: lower ``n_batch``
    for large vocabularies on memory-tight middle stages.

    ``n_gpu_layers`` is llama.cpp's: on a GPU build, the stage's last layers that go to
    its GPUs (one more than ``n_layers``: the output head too); 0, the default, keeps
    everything on the CPU (llama.cpp's own default would offload all of it).

    ``flash_attn`` picks the attention kernels for f16 K/V (see :attr:`flash_attn`):
    None, the default, is plain attention on the CPU and llama.cpp's choice with GPU
    layers.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        first: bool,
        last: bool,
        n_ctx: int,
        n_seq_max: int,
        exact: bool = False,
        n_threads: int | None = None,
        n_batch: int = 512,
        kv_cache: str = "f16",
        n_gpu_layers: int = 0,
        flash_attn: bool | None = None,
    ) -> None:
        path = Path(path)
        if kv_cache not in KV_CACHE_GGML:
            raise ValueError(
                f"kv_cache must be one of {', '.join(KV_CACHE_GGML)}, not {kv_cache!r}"
            )
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max must be positive, got {n_seq_max}")
        if n_batch < 1:
            raise ValueError(f"n_batch must be positive, got {n_batch}")
        check_gguf_file(path)
        backend = _get_backend()
        self._ggml = backend.ggml
        L = self._L = backend.L
        self.path = path
        self.first = first
        self.last = last
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.exact = exact
        self.kv_cache = kv_cache
        self.n_threads = n_threads or default_threads()

        max_seqs = int(L.llama_max_parallel_sequences())
        if n_seq_max > max_seqs:
            raise ValueError(f"n_seq_max {n_seq_max} is over llama.cpp's {max_seqs}")
        self._model: Any = None
        self._ctx: Any = None
        self._embed_ctx: Any = None
        self._cb_eval: Any = None
        mparams = L.llama_model_default_params()
        # llama.cpp's default offloads every layer to a GPU build's devices, whatever
        # they hold; placement says how many fit (0 on a machine without one).
        mparams.n_gpu_layers = n_gpu_layers
        self.n_gpu_layers = n_gpu_layers
        self._flash_attn = flash_attn
        # A build with Intel AMX repacks weights for it, and its matmul crashes the
        # process at the first prompt on AMX machines (llama.cpp #20824; seen here
        # on Sapphire Rapids with Q4_1 and Q4_K). Without extra buffer types the
        # weights stay as the file has them: slower on such a build, never a crash.
        mparams.use_extra_bufts = not backend.amx
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise StageError(f"llama.cpp could not load {path}")
        self._model = model
        self._vocab = L.llama_model_get_vocab(model)
        #: Number of layers in this stage's file (the slice's block_count).
        self.n_layers = int(L.llama_model_n_layer(model))
        #: Width of the residual stream: the hidden rows a stage takes and returns.
        self.hidden_size = int(L.llama_model_n_embd(model))
        #: Vocabulary size; every slice carries the whole vocabulary.
        self.n_vocab = int(L.llama_vocab_n_tokens(self._vocab))
        #: Context the model was trained for (0 = the file does not say).
        self.n_ctx_train = int(L.llama_model_n_ctx_train(model))
        self._read_kind(path, model)
        self._target = f"l_out-{self.n_layers - 1}".encode()

        n_cells = n_ctx * n_seq_max
        cparams = self._cparams(n_cells, n_seq_max, self.flash_attn)
        self.n_batch = min(n_batch, n_cells)
        if not self.flash_attn:
            # Plain attention holds every score of a call: rows x cells x heads, f32.
            per_row = n_cells * int(L.llama_model_n_head(model)) * 4
            self.n_batch = min(self.n_batch, max(MIN_BATCH, PLAIN_ATTENTION_BYTES // per_row))
        cparams.n_batch = self.n_batch
        # One ubatch per decode: the capture sees each decode's rows in one piece.
        cparams.n_ubatch = self.n_batch
        cparams.embeddings = False
        if not last:
            # Held on self: llama.cpp keeps only the C pointer, and a collected
            # ctypes callback would be a call into freed memory.
            self._cb_eval = L.ggml_backend_sched_eval_callback(self._on_eval)
            cparams.cb_eval = self._cb_eval
            cparams.cb_eval_user_data = None
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise StageError(f"llama.cpp could not create a context for {path}")
        self._ctx = ctx
        self._mem = L.llama_get_memory(ctx)

        # Capture state, set by forward() around each llama_decode.
        self._cap_dst: npt.NDArray[np.float32] | None = None
        self._cap_row = 0
        self._cap_end = 0
        self._cap_error: str | None = None
        self._tok = LlamaVocab(L, self._vocab)
        self._alloc_batch()

    def _read_kind(self, path: Path, model: Any) -> None:
        """What kind of model the stage's file holds, from its metadata and llama.cpp."""
        meta = read_metadata(path, keys=["general.architecture"])
        arch = str(meta.get("general.architecture", ""))
        keys = [f"{arch}.attention.causal", f"{arch}.embedding_scale", f"{arch}.embedding_length"]
        more = read_metadata(path, keys=keys)
        #: False for an encoder (BERT-like): it only embeds, over whole inputs at once.
        self.generative = not embedding_only(arch, more)
        #: Recurrent layers (SSM, RWKV, short convolutions): one state per sequence,
        #: which llama.cpp cannot cut back (see meshd.domain.recurrent).
        L = self._L
        self.recurrent = bool(L.llama_model_is_recurrent(model) or L.llama_model_is_hybrid(model))
        #: What this graph multiplies its input rows by: hidden rows from the stage
        #: before are divided by it first, so they are scaled once, as in the whole model.
        scale = input_scale(more, arch) if not self.first else 1.0
        self.input_scale = np.float32(scale)
        #: Positions a row takes in a batch: M-RoPE reads 4 (one a section) for hidden
        #: rows, where it repeats a token id's one (see meshd.models.scaling).
        mrope = (L.LLAMA_ROPE_TYPE_MROPE, L.LLAMA_ROPE_TYPE_IMROPE)
        self.n_pos = 4 if not self.first and L.llama_model_rope_type(model) in mrope else 1

    def _cparams(self, n_cells: int, n_seq_max: int, flash: bool | None) -> Any:
        """Context parameters shared by the stage's context and its embeddings one."""
        L = self._L
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_cells
        cparams.n_seq_max = n_seq_max
        # See the class docstring: per-sequence room and row order both need this.
        cparams.kv_unified = True
        # 0 = no per-sequence cap on output rows: a non-last stage outputs them all.
        cparams.n_outputs_max_per_seq = 0
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.no_perf = True
        cparams.flash_attn_type = {
            None: L.LLAMA_FLASH_ATTN_TYPE_AUTO,
            True: L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            False: L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash]
        if self.exact:
            cparams.type_k = L.GGML_TYPE_F32
            cparams.type_v = L.GGML_TYPE_F32
        elif self.kv_cache != "f16":
            cparams.type_k = cparams.type_v = getattr(L, KV_CACHE_GGML[self.kv_cache])
        return cparams

    @property
    def flash_attn(self) -> bool | None:
        """Whether the stage's attention is llama.cpp's flash attention (None: its
        own choice, ``auto``): see :func:`meshd.engines.attention.flash_attn`."""
        return attention.flash_attn(self.kv_cache, self.n_gpu_layers, self.exact, self._flash_attn)

    def set_threads(self, n: int) -> int:
        """Compute the next steps (prompts and decodes) with ``n`` CPU threads; the count
        llama.cpp holds now. Between steps only (see :mod:`meshd.engines.freecores`)."""
        self.n_threads = n = max(1, int(n))
        for ctx in (c for c in (self._ctx, self._embed_ctx) if c):
            self._L.llama_set_n_threads(ctx, n, n)
        return int(self._L.llama_n_threads(self._ctx)) if self._ctx else n

    @property
    def kept_rows(self) -> int:
        """Rows of other work after which a sequence kept for no request (a cached
        prefix) has cost what computing it again would (see
        :func:`meshd.engines.attention.kept_rows`)."""
        return attention.kept_rows(self.flash_attn)

    # -- batch ---------------------------------------------------------------------

    def _alloc_batch(self) -> None:
        """A llama_batch whose arrays are numpy buffers owned by this stage.

        Built by hand rather than with llama_batch_init so that whole columns are
        filled with numpy slices (no per-token Python loop) and nothing needs
        llama_batch_free.
        """
        cap = self.n_batch
        self._b_pos = np.zeros(cap * self.n_pos, np.int32)
        self._b_nseq = np.ones(cap, np.int32)
        self._b_seq = np.zeros(cap, np.int32)
        self._b_out = np.zeros(cap, np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self._b_seq.ctypes.data
        # seq_id is an array of per-token pointers; each points at that token's
        # single entry in _b_seq (every token belongs to exactly one sequence).
        self._b_seq_ptrs = (i32p * cap)(*[ctypes.cast(base + 4 * i, i32p) for i in range(cap)])
        batch = self._L.llama_batch()
        batch.n_tokens = 0
        #: A first stage's embedding rows (an image's), allocated on first use.
        self._b_embd0: npt.NDArray[np.float32] | None = None
        if self.first:
            self._b_tok: npt.NDArray[np.int32] | None = np.zeros(cap, np.int32)
            self._b_embd: npt.NDArray[np.float32] | None = None
            batch.token = self._b_tok.ctypes.data_as(ctypes.POINTER(self._L.llama_token))
            batch.embd = None
        else:
            self._b_tok = None
            self._b_embd = np.zeros((cap, self.hidden_size), np.float32)
            batch.token = None
            batch.embd = self._b_embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        batch.pos = self._b_pos.ctypes.data_as(ctypes.POINTER(self._L.llama_pos))
        batch.n_seq_id = self._b_nseq.ctypes.data_as(i32p)
        batch.seq_id = ctypes.cast(self._b_seq_ptrs, ctypes.POINTER(i32p))
        batch.logits = self._b_out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = batch

    # -- capture -------------------------------------------------------------------

    def _on_eval(self, t: int, ask: bool, user_data: int) -> bool:
        """Scheduler callback: observe ``l_out-{n_layer-1}``, then stop the graph.

        With ``ask`` set, llama.cpp asks whether we want to see node ``t``; only the
        last layer's output is wanted, so the graph runs in one piece up to it. Called
        again once it is computed: copy its rows out and return False, which cancels
        the final norm and lm_head that a non-last stage does not need.
        """
        g = self._ggml
        try:
            if ask:
                return bool(g.get_name(t) == self._target)
            dst = self._cap_dst
            if dst is None:
                return False
            n_el = int(g.nelements(t))
            rows, rem = divmod(n_el, self.hidden_size)
            if rem or int(g.nbytes(t)) != 4 * n_el:
                self._cap_error = f"{self._target.decode()} is not f32 rows of {self.hidden_size}"
                return False
            if self._cap_row + rows > self._cap_end:
                self._cap_error = f"captured {self._cap_row + rows} rows, expected {self._cap_end}"
                return False
            # Straight into the caller's array: llama.cpp reuses this tensor's memory
            # on the next decode, so it must be copied before we return.
            g.tensor_get(t, dst.ctypes.data + self._cap_row * dst.strides[0], 0, 4 * n_el)
            self._cap_row += rows
            return False
        except Exception as e:  # an exception cannot cross into C: record it
            self._cap_error = f"capture failed: {e!r}"
            return False

    # -- requests ------------------------------------------------------------------

    def n_past(self, seq: int) -> int:
        """Positions the stage holds for ``seq`` (the next input's ``pos``)."""
        self._check_open()
        return int(self._L.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def free(self, seq: int) -> None:
        """Release a request's KV cache; its seq id can start a new request at pos 0."""
        self._check_open()
        check_seq(seq, self.n_seq_max)
        self._L.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def share(self, src: int, dst: int, n: int) -> None:
        """Make the empty ``dst`` hold ``src``'s first ``n`` positions: the cells are
        shared (one KV buffer holds every sequence), nothing is copied."""
        self._check_open()
        check_seq(src, self.n_seq_max)
        check_seq(dst, self.n_seq_max)
        past = self.n_past(src)
        # A recurrent state is the whole sequence's: only all of it can be copied.
        if self.n_past(dst) != 0 or past < n or (self.recurrent and past != n):
            raise StageInputError(f"cannot share {n} positions of seq {src} with seq {dst}")
        self._L.llama_memory_seq_cp(self._mem, src, dst, 0, n)

    def truncate(self, seq: int, n: int) -> None:
        """Keep only ``seq``'s first ``n`` positions."""
        self._check_open()
        check_seq(seq, self.n_seq_max)
        if not 0 <= n <= self.n_past(seq):
            raise StageInputError(f"cannot keep {n} positions of seq {seq}")
        # llama.cpp refuses (False) to cut a recurrent state back: never go on with it.
        if not self._L.llama_memory_seq_rm(self._mem, seq, n, -1):
            raise StageInputError(f"cannot cut seq {seq} back to {n} positions (recurrent state)")

    def _check_open(self) -> None:
        if self._ctx is None:
            raise StageError("stage is closed")

    def forward(self, items: Sequence[StageInput]) -> list[StageOutput]:
        """Run this stage's layers on several requests at once; outputs in item order.

        Each output is a :data:`StageOutput`: hidden rows ``(n, hidden_size)`` on a
        stage that is not last, the last row's logits ``(n_vocab,)`` on the last one.

        All items go through one ``llama_decode`` call (several when their rows
        together pass ``n_batch``; then in order, and an item may span two calls).
        Raises StageInputError (before decoding anything) for an item that does not
        fit, StageError if llama.cpp fails; then every item's sequence is rolled back
        to its ``pos`` so the request can be retried or freed.
        """
        self._check_open()
        if not items:
            return []
        if (
            self.first
            and self.last
            and len(items) <= self.n_batch
            and all(_one_token(it) for it in items)
        ):
            return self._decode_step(items)
        if self.first and any(it.hidden is not None for it in items):
            return self._forward_mixed(items)
        return self._forward(items)

    def _forward(self, items: Sequence[StageInput]) -> list[StageOutput]:
        """:meth:`forward` of items that all take the batch's kind of input."""
        inputs = validate_inputs(self, items)
        lengths = [len(a) for a in inputs]
        total = sum(lengths)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        pos = np.concatenate(
            [np.arange(it.pos, it.pos + n) for it, n in zip(items, lengths, strict=True)]
        )
        seqs = np.repeat(np.array([it.seq for it in items], np.int32), lengths)
        flat = np.concatenate(inputs) if len(inputs) > 1 else inputs[0]
        n_logits = np.array([it.n_logits for it in items])
        if self.last:
            # Only each item's last rows are sampled from: ask llama.cpp for those.
            outs = np.zeros(total, np.int8)
            outs[ends - 1] = 1
            for k in np.flatnonzero(n_logits > 1):  # speculative steps only
                outs[ends[k] - n_logits[k] : ends[k]] = 1
            hidden_out = None
        else:
            # Every row goes on to the next stage; rows not marked as outputs are
            # dropped by llama.cpp before the last layer.
            outs = np.ones(total, np.int8)
            hidden_out = np.empty((total, self.hidden_size), np.float32)

        logits: list[list[npt.NDArray[np.float32]]] = [[] for _ in items]
        try:
            for c0 in range(0, total, self.n_batch):
                c1 = min(total, c0 + self.n_batch)
                self._decode_chunk(flat, pos, seqs, outs, c0, c1, hidden_out)
                if self.last:
                    for k in np.nonzero((ends - n_logits < c1) & (ends > c0))[0]:
                        lo, hi = max(int(ends[k] - n_logits[k]), c0), min(int(ends[k]), c1)
                        logits[k] += [self._logits_row(i - c0) for i in range(lo, hi)]
        except BaseException:
            for it in items:
                self._L.llama_memory_seq_rm(self._mem, it.seq, it.pos, -1)
            raise

        if self.last:
            return [rows[0] if len(rows) == 1 else np.stack(rows) for rows in logits]
        assert hidden_out is not None
        # Views of one array made for this call: nothing else ever writes to it.
        return [hidden_out[s:e] for s, e in zip(starts, ends, strict=True)]

    def _forward_mixed(self, items: Sequence[StageInput]) -> list[StageOutput]:
        """:meth:`forward` on a first stage whose items carry embedding rows too (an
        image's, from the projector): llama.cpp takes tokens or embeddings in one
        batch, never both, so the token items run first, then the row items, through
        a batch that takes embeddings. A failure rolls every item back, as forward's."""
        rows = [i for i, it in enumerate(items) if it.hidden is not None]
        toks = [i for i, it in enumerate(items) if it.hidden is None]
        out: list[StageOutput | None] = [None] * len(items)
        try:
            if toks:
                for i, o in zip(toks, self._forward([items[i] for i in toks]), strict=True):
                    out[i] = o
            with self._embedding_input():
                for i, o in zip(rows, self._forward([items[i] for i in rows]), strict=True):
                    out[i] = o
        except BaseException:
            for it in items:
                self._L.llama_memory_seq_rm(self._mem, it.seq, it.pos, -1)
            raise
        return [o for o in out if o is not None]

    @contextlib.contextmanager
    def _embedding_input(self) -> Iterator[None]:
        """The batch takes embedding rows for a while (a first stage's image rows)."""
        if self._b_embd0 is None:
            self._b_embd0 = np.zeros((self.n_batch, self.hidden_size), np.float32)
        batch, tok = self._batch, self._b_tok
        self._b_tok, self._b_embd = None, self._b_embd0
        batch.token = None
        batch.embd = self._b_embd0.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        try:
            yield
        finally:
            self._b_tok, self._b_embd = tok, None
            assert tok is not None
            batch.token = tok.ctypes.data_as(ctypes.POINTER(self._L.llama_token))
            batch.embd = None

    def projector(self, path: Path | str) -> Projector:
        """The image projector at ``path`` for this stage's model (a first stage's:
        its rows go in where the token embeddings would)."""
        return Projector(path, self._model, self.hidden_size, self.n_threads, _get_backend().log_cb)

    def _decode_step(self, items: Sequence[StageInput]) -> list[StageOutput]:
        """:meth:`forward` for one new token per request on a whole-model stage (each
        decode step of a one-stage instance): the same checks, errors and outputs in
        fewer interpreted steps. Why it pays: a decode streams the weights through the
        caches, and each Python step after it runs ~10x slower than warm (measured:
        0.2 ms a step on the general path, 4% of a small model's token on 2 cores)."""
        n_ctx, n_vocab, n_seq_max = self.n_ctx, self.n_vocab, self.n_seq_max
        seen: set[int] = set()
        for i, it in enumerate(items):
            seq, pos = it.seq, it.pos
            check_seq(seq, n_seq_max)
            if seq in seen:
                raise StageInputError(f"seq {seq} appears twice in one forward")
            seen.add(seq)
            tok = int(it.tokens[0])  # type: ignore[index]  # stage 0's items carry tokens
            if not 0 <= tok < n_vocab:
                raise StageInputError(f"token id outside [0, {n_vocab})")
            past = self.n_past(seq)
            if pos != past:
                raise StageInputError(f"seq {seq}: pos {pos} but the stage holds {past}")
            if pos + 1 > n_ctx:
                raise ContextFullError(f"seq {seq}: {pos} + 1 positions exceed n_ctx {n_ctx}")
            self._b_tok[i] = tok  # type: ignore[index]  # allocated with the batch
            self._b_pos[i] = pos
            self._b_seq[i] = seq
        n = len(items)
        self._b_out[:n] = 1
        self._batch.n_tokens = n
        ret = int(self._L.llama_decode(self._ctx, self._batch))
        if ret != 0:
            for it in items:
                self._L.llama_memory_seq_rm(self._mem, it.seq, it.pos, -1)
            why = {1: "no KV cache slot", 2: "aborted"}.get(ret, "invalid batch or error")
            raise StageError(f"llama_decode returned {ret} ({why})")
        ptr = self._L.llama_get_logits(self._ctx)  # the rows in batch order
        if not ptr:
            raise StageError("llama.cpp gave no logits")
        # Copy: llama.cpp overwrites its logits buffer on the next decode.
        return list(np.ctypeslib.as_array(ptr, shape=(n, n_vocab)).copy())

    def _fill_batch(
        self,
        flat: np.ndarray,
        pos: np.ndarray,
        seqs: np.ndarray,
        outs: np.ndarray,
        c0: int,
        c1: int,
    ) -> None:
        """Put rows ``c0:c1`` in the batch (tokens or hidden rows, by stage)."""
        n = c1 - c0
        if self._b_tok is not None:
            self._b_tok[:n] = flat[c0:c1]
        else:
            assert self._b_embd is not None
            if self.input_scale != 1:
                np.divide(flat[c0:c1], self.input_scale, out=self._b_embd[:n])
            else:
                self._b_embd[:n] = flat[c0:c1]
        self._b_pos[: n * self.n_pos].reshape(self.n_pos, n)[:] = pos[c0:c1]  # each section
        self._b_seq[:n] = seqs[c0:c1]
        self._b_out[:n] = outs[c0:c1]
        self._batch.n_tokens = n

    def _decode_chunk(
        self,
        flat: np.ndarray,
        pos: np.ndarray,
        seqs: np.ndarray,
        outs: np.ndarray,
        c0: int,
        c1: int,
        hidden_out: npt.NDArray[np.float32] | None,
    ) -> None:
        n = c1 - c0
        self._fill_batch(flat, pos, seqs, outs, c0, c1)
        self._cap_dst = hidden_out
        self._cap_row = c0
        self._cap_end = c1
        self._cap_error = None
        try:
            ret = int(self._L.llama_decode(self._ctx, self._batch))
        finally:
            self._cap_dst = None
        if ret != 0:
            why = {1: "no KV cache slot", 2: "aborted"}.get(ret, "invalid batch or error")
            raise StageError(f"llama_decode returned {ret} ({why})")
        if self._cap_error is not None:
            raise StageError(self._cap_error)
        if hidden_out is not None and self._cap_row != c1:
            raise StageError(
                f"captured {self._cap_row - c0} hidden rows of {n}: "
                f"{self._target.decode()} was not seen"
            )

    def embed(self, items: Sequence[StageInput]) -> list[npt.NDArray[np.float32]]:
        """For each item, the final hidden states (after the output norm) of every row
        of its input, ``(n, hidden_size)``, from a context of their own: no sequence's
        KV is touched and nothing is kept. Last stage only (see :meth:`Stage.embed`).

        That context (``embeddings`` on, no pooling: the runner pools) is made on the
        first call with ``n_ctx`` cells and ``n_seq_max`` sequences; inputs share its
        decodes, as many at once as fit.
        """
        self._check_open()
        inputs = validate_embed_inputs(self, items)
        ctx = self._embedding_context()
        # An encoder attends both ways: llama.cpp needs each input whole in one ubatch,
        # so a group is what one decode holds.
        room = self.n_ctx if self.generative else self._embed_batch
        out: list[npt.NDArray[np.float32]] = []
        group: list[np.ndarray] = []
        for a in inputs:
            if len(a) > room:
                raise ContextFullError(f"{len(a)} positions exceed {room} for one input")
            if group and (sum(map(len, group)) + len(a) > room or len(group) == self.n_seq_max):
                out += self._embed_group(ctx, group)
                group = []
            group.append(a)
        if group:
            out += self._embed_group(ctx, group)
        return out

    @property
    def _embed_batch(self) -> int:
        """Rows one embeddings decode takes (an encoder's whole context: see embed)."""
        return min(self.n_batch, self.n_ctx) if self.generative else self.n_ctx

    def _embedding_context(self) -> Any:
        if self._embed_ctx is None:
            L = self._L
            # The same attention as the stage's own context: on a split, the stages
            # before the last compute an input's rows in theirs.
            cparams = self._cparams(self.n_ctx, self.n_seq_max, self.flash_attn)
            cparams.n_batch = cparams.n_ubatch = self._embed_batch
            cparams.embeddings = True
            cparams.pooling_type = L.LLAMA_POOLING_TYPE_NONE
            ctx = L.llama_init_from_model(self._model, cparams)
            if not ctx:
                raise StageError(f"llama.cpp made no embeddings context for {self.path}")
            self._embed_ctx = ctx
        return self._embed_ctx

    def _embed_group(self, ctx: Any, inputs: list[np.ndarray]) -> list[npt.NDArray[np.float32]]:
        """Inputs whose rows fit the embeddings context together, each its own sequence."""
        L = self._L
        lengths = [len(a) for a in inputs]
        total = sum(lengths)
        flat = np.concatenate(inputs) if len(inputs) > 1 else inputs[0]
        pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
        seqs = np.repeat(np.arange(len(inputs), dtype=np.int32), lengths)
        outs = np.ones(total, np.int8)
        rows = np.empty((total, self.hidden_size), np.float32)
        step = self._embed_batch
        try:
            for c0 in range(0, total, step):
                c1 = min(total, c0 + step)
                self._fill_batch(flat, pos, seqs, outs, c0, c1)
                ret = int(L.llama_decode(ctx, self._batch))
                if ret != 0:
                    raise StageError(f"llama_decode (embeddings) returned {ret}")
                ptr = L.llama_get_embeddings(ctx)
                if not ptr:
                    raise StageError("llama.cpp gave no embeddings")
                n = (c1 - c0) * self.hidden_size
                rows[c0:c1] = np.ctypeslib.as_array(ptr, shape=(n,)).reshape(c1 - c0, -1)
        finally:
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
        ends = np.cumsum(lengths)
        return [rows[e - n : e] for e, n in zip(ends, lengths, strict=True)]

    def _logits_row(self, i: int) -> npt.NDArray[np.float32]:
        ptr = self._L.llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise StageError(f"llama.cpp has no logits for batch row {i}")
        # Copy: llama.cpp overwrites its logits buffer on the next decode.
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    # -- tokenizer -----------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS/EOS as the model asks,
        ``parse_special`` turns special-token text (``<|im_start|>``) into its id."""
        self._check_open()
        return self._tok.tokenize(text, add_special, parse_special)

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token (possibly part of a UTF-8 character).

        ``special`` renders control tokens (``<|im_end|>``) as their text; by default
        they render as nothing, which is what a chat reply shows.
        """
        self._check_open()
        return self._tok.token_to_piece(token, special)

    def eos_tokens(self) -> set[int]:
        """Ids that end a generation: eos, eot and every end-of-generation token."""
        self._check_open()
        return self._tok.eos_tokens()

    def special_texts(self) -> tuple[str, str]:
        """The BOS and EOS token texts chat templates get ("" when the model has none)."""
        self._check_open()
        return self._tok.bos_token or "", self._tok.eos_token or ""

    # -- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Free the contexts and the model. Safe to call twice."""
        L = self._L
        for name, free in (("_embed_ctx", L.llama_free), ("_ctx", L.llama_free),
                           ("_model", L.llama_model_free)):  # fmt: skip
            if getattr(self, name) is not None:
                free(getattr(self, name))
                setattr(self, name, None)

    def __enter__(self) -> LlamaStage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = stage_role(self.first, self.last)
        return (
            f"LlamaStage({self.path.name}, {role}, layers={self.n_layers}, "
            f"n_ctx={self.n_ctx}, n_seq_max={self.n_seq_max}, exact={self.exact})"
        )

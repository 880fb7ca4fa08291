"""A model's image projector (mmproj) at stage 0: llama.cpp's libmtmd through
llama-cpp-python's ctypes bindings (``llama_cpp.mtmd_cpp``).

An image becomes what the model reads in its place: the projector's chunks for it,
in order; text chunks (the begin/end tokens some projectors wrap an image in) as
token ids, the image chunk as rows of embeddings, ``(n, hidden_size)`` float32, which
stage 0 feeds into its first layer where the token embeddings would go. Later stages
see hidden rows as always.

What this runner does not carry (yet): M-RoPE positions (Qwen-VL's image rows take
2-D positions at every layer) and non-causal attention over an image's rows
(Gemma 3): a projector that needs them refuses each image with
:class:`ProjectorError`, which the API answers as a 400 that names the reason.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from meshd.domain.images import IMAGE_FORMATS, image_format

__all__ = ["Chunk", "Projector", "ProjectorError"]

#: One chunk of an image: token ids (int32) or embedding rows (float32, 2-D).
Chunk = npt.NDArray[np.int32] | npt.NDArray[np.float32]

#: What mtmd puts in a prompt where an image goes (llama.cpp's default marker).
_MARKER = b"<__media__>"
#: A folder with no programs in it, where llama.cpp's helper looks for ffmpeg.
_NO_PROGRAMS = b"/nonexistent/meshd-starts-no-ffmpeg"


class ProjectorError(ValueError):
    """An image this projector cannot read, or a projector this runner cannot run."""


def _mtmd() -> Any:
    # Imported on first use: a node without images never loads libmtmd.
    from llama_cpp import mtmd_cpp

    return mtmd_cpp


class Projector:
    """The projector file ``path`` for the text model ``model`` (a ``llama_model*``
    of the stage that embeds tokens: it gives the vocabulary and the width the
    projector must match, ``width`` wide). ``n_threads`` threads encode an image on
    the CPU; ``log_cb``: where libmtmd's log goes (a ``llama_log_callback``)."""

    def __init__(
        self, path: Path | str, model: Any, width: int, n_threads: int, log_cb: Any = None
    ) -> None:
        m = _mtmd()
        self._m = m
        if log_cb is not None:
            # libmtmd logs each image at INFO on stderr; the stage's logger keeps
            # warnings and errors (``log_cb``: a llama_log_callback it holds).
            m.mtmd_helper_log_set(log_cb, ctypes.c_void_p(0))
        self.path = Path(path)
        params = m.mtmd_context_params_default()
        params.use_gpu = False
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        ctx = m.mtmd_init_from_file(str(self.path).encode(), model, params)
        if not ctx:
            raise ProjectorError(f"llama.cpp could not load the projector {self.path}")
        self._ctx = ctx
        #: Width of its rows: the text model's (mtmd refuses a projector that differs).
        self.width = width
        self._lock = threading.Lock()
        #: Why every image is refused ("" when images are read).
        self.unsupported = ""
        if not m.mtmd_support_vision(ctx):
            self.unsupported = "its projector reads no images (audio only)"
        elif m.mtmd_decode_use_mrope(ctx):
            self.unsupported = (
                "its projector places image rows with M-RoPE (Qwen-VL), which meshd's "
                "stages do not carry yet"
            )

    def chunks(self, image: bytes) -> list[Chunk]:
        """What the model reads for ``image`` (a PNG, JPEG... file), in order.
        :class:`ProjectorError` for a file the projector cannot decode."""
        if self.unsupported:
            raise ProjectorError(self.unsupported)
        m = self._m
        if image_format(image) is None:
            raise ProjectorError(f"the file is not an image meshd reads ({IMAGE_FORMATS})")
        with self._lock:
            buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
            opt = m.mtmd_helper_init_opt_default()
            # A file stb_image cannot decode goes on to ffmpeg where llama.cpp finds
            # one: a runner decodes images, nothing else, and starts no program.
            opt.video_params.ffmpeg_bin_dir = _NO_PROGRAMS
            bitmap = m.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(image), False, opt)
            if not bitmap:
                raise ProjectorError(f"the image could not be decoded ({IMAGE_FORMATS})")
            chunks = m.mtmd_input_chunks_init()
            try:
                text = m.mtmd_input_text(_MARKER, len(_MARKER), False, True)
                bitmaps = (m.mtmd_bitmap_p_ctypes * 1)(bitmap)
                ret = m.mtmd_tokenize(self._ctx, chunks, ctypes.byref(text), bitmaps, 1)
                if ret != 0:
                    raise ProjectorError(f"the projector could not take the image ({ret})")
                return [self._chunk(m.mtmd_input_chunks_get(chunks, i))
                        for i in range(m.mtmd_input_chunks_size(chunks))]  # fmt: skip
            finally:
                m.mtmd_input_chunks_free(chunks)
                m.mtmd_bitmap_free(bitmap)

    def _chunk(self, chunk: Any) -> Chunk:
        m = self._m
        kind = m.mtmd_input_chunk_get_type(chunk)
        if kind == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t(0)
            ptr = m.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            return np.ctypeslib.as_array(ptr, shape=(n.value,)).astype(np.int32)
        if kind != m.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            raise ProjectorError("the projector gave a chunk that is no image")
        if m.mtmd_decode_use_non_causal(self._ctx, chunk):
            raise ProjectorError(
                "its image rows attend to each other both ways (Gemma 3), which meshd's "
                "stages do not run yet"
            )
        if m.mtmd_encode_chunk(self._ctx, chunk) != 0:
            raise ProjectorError("the projector failed to encode the image")
        n_rows = int(m.mtmd_input_chunk_get_n_tokens(chunk))
        width = self.width
        ptr = m.mtmd_get_output_embd(self._ctx)
        total = n_rows * width
        if not total or not ptr:
            raise ProjectorError("the projector gave no rows")
        # Copied: the next encode overwrites the projector's output buffer.
        return np.ctypeslib.as_array(ptr, shape=(total,)).reshape(n_rows, width).copy()

    def close(self) -> None:
        """Free the projector (idempotent)."""
        if self._ctx:
            self._m.mtmd_free(self._ctx)
            self._ctx = None

"""A small synthetic vision model for tests: a text model (``tests.synthetic``) and
an image projector (``mmproj``) beside it, both real GGUF files llama.cpp loads, with
seeded random weights; and small PNG images written by hand.

The projector is LLaVA 1.5's kind (``clip.projector_type = mlp``), the simplest that
llama.cpp's clip.cpp runs: a ViT (a patch convolution, learned positions, pre-norm
blocks with GELU FFNs) whose next-to-last layer's patch rows go through a 2-layer
MLP (``mm.0``, GELU, ``mm.2``) into the text model's width. The image is resized to
``IMAGE_SIZE`` square, so every image gives ``(IMAGE_SIZE // PATCH) ** 2`` rows.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import gguf
import numpy as np

from tests.synthetic import write_model

#: The projector's input side, its patches, and its width.
IMAGE_SIZE, PATCH, WIDTH = 28, 14, 32
#: Rows one image becomes: a 2 x 2 grid of patches.
N_IMAGE_ROWS = (IMAGE_SIZE // PATCH) ** 2
#: Width of the text model (``tests.synthetic.write_model``): the projector's output.
TEXT_WIDTH = 64


def write_projector(path: Path, *, blocks: int = 2, seed: int = 11) -> Path:
    """An MLP (LLaVA) projector GGUF for a ``TEXT_WIDTH``-wide text model. The rows
    are scaled up so that an image moves the model's answer (random weights)."""
    rng = np.random.default_rng(seed)
    ff = 2 * WIDTH
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", PATCH)
    w.add_uint32("clip.vision.embedding_length", WIDTH)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.projection_dim", TEXT_WIDTH)
    w.add_uint32("clip.vision.block_count", blocks)
    w.add_uint32("clip.vision.attention.head_count", 2)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def t(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    # GGUF shapes are numpy's reversed: the kernel is ggml's [KW, KH, IC, OC].
    w.add_tensor("v.patch_embd.weight", t(WIDTH, 3, PATCH, PATCH, scale=0.05))
    w.add_tensor("v.patch_embd.bias", t(WIDTH))
    w.add_tensor("v.position_embd.weight", t(N_IMAGE_ROWS, WIDTH))
    for i in range(blocks):
        p = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(p + name + ".weight", t(WIDTH, WIDTH))
            w.add_tensor(p + name + ".bias", t(WIDTH))
        for name in ("ln1", "ln2"):
            w.add_tensor(p + name + ".weight", (1 + t(WIDTH)).astype(np.float32))
            w.add_tensor(p + name + ".bias", t(WIDTH))
        w.add_tensor(p + "ffn_up.weight", t(ff, WIDTH))
        w.add_tensor(p + "ffn_up.bias", t(ff))
        w.add_tensor(p + "ffn_down.weight", t(WIDTH, ff))
        w.add_tensor(p + "ffn_down.bias", t(WIDTH))
    w.add_tensor("mm.0.weight", t(TEXT_WIDTH, WIDTH, scale=0.5))
    w.add_tensor("mm.0.bias", t(TEXT_WIDTH))
    w.add_tensor("mm.2.weight", t(TEXT_WIDTH, TEXT_WIDTH, scale=1.0))
    w.add_tensor("mm.2.bias", t(TEXT_WIDTH))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_vision_model(folder: Path, tokenizer_from: Path, name: str = "vision") -> Path:
    """``folder/<name>.gguf`` (a llama text model) with ``folder/mmproj-<name>.gguf``
    beside it; the model's path."""
    folder.mkdir(parents=True, exist_ok=True)
    model = write_model(folder / f"{name}.gguf", tokenizer_from, "llama")
    write_projector(folder / f"mmproj-{name}.gguf")
    return model


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of ``width`` x ``height`` random RGB pixels (8-bit, no filter)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )

"""A prompt's images at stage 0: where their rows lie in the prompt, what stands for
them in its token list, and the steps that feed them (see ``meshd.engines.projector``
for how an image becomes rows)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np

from meshd.engines.projector import Projector
from meshd.engines.protocol import RunnerConfig
from meshd.engines.stage import Stage
from meshd.models.projectors import find_projector
from meshd.transport import wire

from .state import Work

log = logging.getLogger("meshd.runner")

#: Why a model without a projector refuses images.
NO_PROJECTOR = (
    "this model reads text only: it has no image projector (an mmproj*.gguf file "
    "beside the model's GGUF, see docs/operations.md)"
)


@dataclass
class ImageRows:
    """An image's rows in a prompt: where they start, and the rows (float32,
    ``(n, hidden_size)``) stage 0 feeds in place of token embeddings."""

    start: int
    rows: np.ndarray


def image_ids(image: bytes, n: int) -> list[int]:
    """What stands for ``n`` rows of ``image`` in a prompt's token list: one negative
    id from the image's bytes (no token has it). The prefix cache matches prompts
    by these lists, so the same text with another image never reuses the wrong KV,
    and the same image's rows are reused."""
    h = int.from_bytes(hashlib.blake2b(image, digest_size=8).digest(), "little")
    return [-1 - (h & 0x3FFFFFFF)] * n


def prompt_work(
    req: str, prompt: list[int], images: list[ImageRows], n_cached: int, start: wire.Start
) -> Work:
    """A prompt's step from ``n_cached`` on: its token runs and its images' rows in
    order (a cached prefix may end inside an image: its other rows then), run as one
    step, so that the prompt crosses a split once (a text prompt goes in chunks
    instead: :mod:`.chunks`)."""
    parts: list[np.ndarray] = []
    pos = n_cached
    for im in images:
        end = im.start + len(im.rows)
        if end <= pos:
            continue
        if im.start > pos:
            parts.append(np.asarray(prompt[pos : im.start], np.int32))
            pos = im.start
        parts.append(im.rows[pos - im.start :])
        pos = end
    if pos < len(prompt) or not parts:
        parts.append(np.asarray(prompt[pos:], np.int32))
    return Work(req, n_cached, parts=parts, start=start)


def open_projector(cfg: RunnerConfig, stage: Stage) -> tuple[Projector | None, str]:
    """Stage 0's image projector: the one beside its model (``find_projector``),
    loaded against ``stage``'s model; else None and why its instance reads no images.
    A projector that fails to load leaves the model serving text (and says why)."""
    path = None if cfg.sliced else find_projector(cfg.model_path)
    if path is None:
        return None, NO_PROJECTOR
    make = getattr(stage, "projector", None)
    if cfg.engine != "llama_cpp" or make is None:
        return None, (
            f"this instance runs on {cfg.engine}, which cannot run the model's image "
            f"projector ({path.name}): place it on llama_cpp to read images"
        )
    try:
        projector: Projector = make(path)
    except Exception as e:
        log.warning("the image projector %s did not load: %s", path, e)
        return None, f"the model's image projector {path.name} did not load: {e}"
    log.info("image projector %s loaded", path.name)
    return projector, ""

"""A prompt's images at stage 0, without a model: where the rows go among the token
runs (from any cached prefix on), what stands for them in the token list the prefix
cache matches, and which projector file is the model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshd.domain.sampling import Sampling
from meshd.engines.runner.images import ImageRows, image_ids, prompt_work
from meshd.models.projectors import find_projector
from meshd.transport import wire

START = wire.Start(
    route=[], reply_to=wire.Addr("n", ["127.0.0.1"], 1), sampling=Sampling(), n_prompt=9
)


def _prompt() -> tuple[list[int], list[ImageRows]]:
    rows = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    tokens = [1, 2, 3, *image_ids(b"png", 4), 7, 8]
    return tokens, [ImageRows(3, rows)]


def _shape(parts: list[np.ndarray] | None) -> list[tuple[int, bool]]:
    return [(len(p), p.ndim == 2) for p in parts or ()]


def test_a_prompt_is_one_step_of_token_runs_and_image_rows_in_order() -> None:
    tokens, images = _prompt()
    w = prompt_work("r", tokens, images, 0, START)
    assert (w.pos, w.rows, w.start) == (0, 9, START)
    assert _shape(w.parts) == [(3, False), (4, True), (2, False)]
    assert w.parts is not None and w.parts[2].tolist() == [7, 8]


def test_a_cached_prefix_may_end_inside_an_image() -> None:
    tokens, images = _prompt()
    w = prompt_work("r", tokens, images, 5, START)
    assert (w.pos, _shape(w.parts)) == (5, [(2, True), (2, False)])
    assert w.parts is not None and np.array_equal(w.parts[0], images[0].rows[2:])
    past = prompt_work("r", tokens, images, 8, START)  # past the image: tokens only
    assert (past.pos, _shape(past.parts)) == (8, [(1, False)])


def test_an_image_stands_as_ids_of_its_bytes_that_no_token_has() -> None:
    a, b = image_ids(b"one image", 3), image_ids(b"another image", 3)
    assert a == image_ids(b"one image", 3) and a != b
    assert all(t < 0 for t in a + b)


def test_the_projector_is_the_mmproj_beside_the_model(tmp_path: Path) -> None:
    model = tmp_path / "gemma-3-4b-it-Q4_K_M.gguf"
    model.write_bytes(b"GGUF")
    assert find_projector(model) is None
    (tmp_path / "mmproj-model-f16.gguf").write_bytes(b"GGUF")
    assert find_projector(model) == tmp_path / "mmproj-model-f16.gguf"
    # Two: the one named after the model, else none (no guess).
    (tmp_path / "mmproj-other.gguf").write_bytes(b"GGUF")
    assert find_projector(model) is None
    (tmp_path / "mmproj-gemma-3-4b-it-Q4_K_M.gguf").write_bytes(b"GGUF")
    assert find_projector(model) == tmp_path / "mmproj-gemma-3-4b-it-Q4_K_M.gguf"

"""A folder slice of an MLX model: the range's tensors renamed from layer 0, bytes as
they were, packed deterministically; unpacked, an MLX stage runs it as the range of
the whole folder."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from meshd.models.convert import gguf_to_mlx_folder
from meshd.models.folder import read_safetensors_header
from meshd.models.folder_slicing import slice_folder, unpack_folder_slice

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def folder(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gguf_to_mlx_folder(model_path, tmp_path_factory.mktemp("mlx") / "smol-mlx")


def test_two_cuts_are_the_same_bytes_and_hold_only_the_range(folder: Path, tmp_path: Path) -> None:
    a = slice_folder(folder, 10, 20, tmp_path / "a", "ab" * 32)
    b = slice_folder(folder, 10, 20, tmp_path / "b", "ab" * 32)
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    with tarfile.open(a) as tar:
        names = tar.getnames()
        assert names == sorted(names) and "model.safetensors" in names
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
    out = unpack_folder_slice(a, tmp_path / "unpacked")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 10
    header = read_safetensors_header(out / "model.safetensors")
    layers = {int(k.split(".")[2]) for k in header if k.startswith("model.layers.")}
    assert layers == set(range(10))
    assert any(k.startswith("model.embed_tokens.") for k in header)
    assert (out / "tokenizer.json").is_file()
    with pytest.raises(ValueError):
        slice_folder(folder, 20, 31, tmp_path / "c", "ab" * 32)


def test_an_unpacked_slice_runs_as_that_range_of_the_whole_folder(
    folder: Path, tmp_path: Path
) -> None:
    from meshd.engines.mlx_stage import MlxStage
    from meshd.engines.stage import StageInput

    sub = unpack_folder_slice(slice_folder(folder, 15, 30, tmp_path, "cd" * 32), tmp_path / "s")
    hidden = np.random.default_rng(3).standard_normal((4, 576)).astype(np.float32)
    outs = []
    for path, (start, end) in ((folder, (15, 30)), (sub, (0, 15))):
        with MlxStage(path, start=start, end=end, first=False, last=True, n_ctx=16,
                      n_seq_max=1) as s:  # fmt: skip
            outs.append(s.forward([StageInput(seq=0, pos=0, hidden=hidden)])[0])
    assert outs[0].shape == outs[1].shape
    assert np.array_equal(outs[0], outs[1])


def test_the_cache_quota_evicts_unused_folder_slices_never_one_in_use(tmp_path: Path) -> None:
    import os

    from meshd.models.slicing import trim_slices

    old, used = tmp_path / "aa" / "0-5.mlx", tmp_path / "aa" / "5-9.mlx"
    for i, d in enumerate((old, used)):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
        os.utime(d, (1000 + i, 1000 + i))
    assert trim_slices(tmp_path, keep=[used], quota=0) == [old]
    assert not old.exists() and used.is_dir()
    assert trim_slices(tmp_path, keep=[used], quota=0) == []

"""Sub-GGUF slices: contents, metadata, on-disk cache, racing cutters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshd.models.errors import ModelFormatError
from meshd.models.facts import read_facts
from meshd.models.slicing import slice_gguf, slice_path, trim_slices
from tests.conftest import MODEL_SHA256

REPO = Path(__file__).resolve().parents[2]


def _tensors(reader: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in reader.tensors}


@pytest.mark.timeout(90)
def test_middle_slice_holds_its_layers_renamed_and_all_metadata(
    model_path: Path, slice_dir: Path, model_reader: gguf.GGUFReader
) -> None:
    path = slice_gguf(model_path, 10, 20, slice_dir, MODEL_SHA256)
    assert path == slice_dir / MODEL_SHA256[:16] / "10-20.gguf"
    assert path == slice_path(slice_dir, MODEL_SHA256, 10, 20)

    src = model_reader
    sub = gguf.GGUFReader(path)
    src_t, sub_t = _tensors(src), _tensors(sub)

    # blk.10..19 became blk.0..9, byte for byte (quantized data copied as it is).
    for name, t in src_t.items():
        if name.startswith("blk."):
            i = int(name.split(".")[1])
            if 10 <= i < 20:
                new = f"blk.{i - 10}." + name.split(".", 2)[2]
                assert sub_t[new].tensor_type == t.tensor_type
                assert list(sub_t[new].shape) == list(t.shape)
                assert np.array_equal(np.asarray(sub_t[new].data), np.asarray(t.data))
        else:
            # Globals every llama.cpp stage needs (token_embd, output_norm) are kept.
            assert np.array_equal(np.asarray(sub_t[name].data), np.asarray(t.data))
    blocks = {int(n.split(".")[1]) for n in sub_t if n.startswith("blk.")}
    assert blocks == set(range(10))
    assert "token_embd.weight" in sub_t and "output_norm.weight" in sub_t
    assert "output.weight" not in sub_t  # tied embeddings: none in the source either

    # Metadata: block_count is the range's length, everything else is unchanged.
    assert sub.fields["llama.block_count"].contents() == 10
    for name, field in src.fields.items():
        if name.startswith("GGUF.") or name == "llama.block_count":
            continue
        assert sub.fields[name].contents() == field.contents(), name
    assert set(sub.fields) == set(src.fields)

    facts = read_facts(path, "slice", sha256="0")
    assert facts.n_layers == 10
    per_block = [0] * 30
    for name, t in src_t.items():
        if name.startswith("blk."):
            per_block[int(name.split(".")[1])] += int(t.n_bytes)
    assert facts.layer_bytes == per_block[10:20]


@pytest.mark.timeout(60)
def test_slice_is_cut_once_and_then_served_from_the_cache(
    model_path: Path, slice_dir: Path
) -> None:
    path = slice_gguf(model_path, 0, 10, slice_dir, MODEL_SHA256)
    before = path.stat()
    again = slice_gguf(model_path, 0, 10, slice_dir, MODEL_SHA256)
    assert again == path
    after = again.stat()
    # The same file, not cut again (a new cut is renamed into place: a new inode); its
    # mtime moves on, as the last use the cache quota goes by.
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert after.st_mtime_ns >= before.st_mtime_ns
    # No temporary file is left behind.
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".")) == []


@pytest.mark.timeout(30)
def test_whole_range_is_the_source_file_itself(model_path: Path, tmp_path: Path) -> None:
    assert slice_gguf(model_path, 0, 30, tmp_path, MODEL_SHA256) == model_path
    assert not (tmp_path / MODEL_SHA256[:16] / "0-30.gguf").exists()


@pytest.mark.timeout(30)
def test_bad_ranges_and_bad_files_are_refused(model_path: Path, tmp_path: Path) -> None:
    for start, end in [(5, 5), (7, 3), (-1, 4), (20, 31)]:
        with pytest.raises(ValueError):
            slice_gguf(model_path, start, end, tmp_path, MODEL_SHA256)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 4096)
    with pytest.raises(ModelFormatError):
        slice_gguf(junk, 0, 1, tmp_path, "0" * 64)


_CUTTER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from meshd.models.slicing import slice_gguf
    src, out, sha = sys.argv[1:4]
    print(slice_gguf(Path(src), 20, 30, Path(out), sha))
    """
)


@pytest.mark.timeout(120)
def test_processes_racing_to_cut_the_same_slice_all_get_a_whole_one(
    model_path: Path, tmp_path: Path
) -> None:
    # A temporary file a dead cutter left a day ago is swept up by the next cut.
    folder = slice_path(tmp_path, MODEL_SHA256, 20, 30).parent
    folder.mkdir(parents=True)
    stale = folder / ".20-30.dead.tmp"
    stale.write_bytes(b"half a slice")
    os.utime(stale, (time.time() - 2 * 86400,) * 2)

    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _CUTTER, str(model_path), str(tmp_path), MODEL_SHA256],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=100) for p in racers]
    assert [p.returncode for p in racers] == [0, 0], [err for _, err in results]
    paths = {out.strip() for out, _ in results}
    expected = slice_path(tmp_path, MODEL_SHA256, 20, 30)
    assert paths == {str(expected)}
    # Whichever rename won, the slice is complete and readable, with nothing left over.
    sub = gguf.GGUFReader(expected)
    assert sub.fields["llama.block_count"].contents() == 10
    assert len([t for t in sub.tensors if t.name.startswith("blk.9.")]) == 9
    assert [p.name for p in expected.parent.iterdir()] == [expected.name]


@pytest.mark.timeout(120)
def test_the_cache_keeps_slices_in_use_and_drops_the_least_recently_used(
    model_path: Path, tmp_path: Path
) -> None:
    a, b, c = (slice_gguf(model_path, s, s + 2, tmp_path, MODEL_SHA256) for s in (0, 10, 20))
    size = a.stat().st_size
    now = time.time()
    for age, path in ((300, a), (200, b), (100, c)):
        os.utime(path, (now - age, now - age))
    # a is the oldest but in use; b is the least recently used of the rest.
    assert trim_slices(tmp_path, keep=[a], quota=2 * size + 1) == [b]
    assert a.is_file() and c.is_file() and not b.is_file()
    # Using a slice again (a cut served from the cache) makes it recent.
    slice_gguf(model_path, 20, 22, tmp_path, MODEL_SHA256)
    assert c.stat().st_mtime >= now
    # Over a zero quota, everything unused goes; what is in use stays whatever its size.
    assert trim_slices(tmp_path, keep=[c], quota=0) == [a]
    assert c.is_file()
    assert trim_slices(tmp_path, keep=[], quota=0) == [c]
    assert not (tmp_path / MODEL_SHA256[:16]).exists()  # the emptied folder too

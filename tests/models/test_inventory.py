"""The models a node holds: every name listed resolves there, to what was found.

Real files in a temp dir: synthetic GGUFs, an MLX folder, a Hugging Face cache laid out
as ``huggingface_hub`` writes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from meshd.models.facts import read_model_facts
from meshd.models.inventory import held_models
from meshd.models.resolve import local_models
from meshd.node.roots import ModelRoots
from tests.models.test_resolve import FakeHub
from tests.synthetic import write_model

pytestmark = pytest.mark.timeout(60)


def write_mlx_folder(folder: Path) -> Path:
    """A config.json and one small, well-formed safetensors file."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    data = np.zeros((2, 4), np.float32).tobytes()
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, len(data)]}}
    ).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    return folder


@pytest.fixture
def synth(tmp_path: Path, model_path: Path) -> Path:
    """A small synthetic GGUF (the default model's tokenizer, random weights)."""
    return write_model(tmp_path / "_synth.gguf", model_path, "llama")


def test_held_models_lists_what_resolves_and_each_name_resolves_through_the_roots(
    tmp_path: Path, hub: FakeHub, synth: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "models"
    d.mkdir()
    shutil.copy(synth, d / "solo.gguf")
    shutil.copy(synth, d / "big-00001-of-00002.gguf")
    shutil.copy(synth, d / "big-00002-of-00002.gguf")  # opened through the first shard
    shutil.copy(synth, d / "vision-mmproj-f16.gguf")  # a projector, no model of its own
    shutil.copy(synth, d / ".hidden.gguf")
    (d / "fake.gguf").write_text("not a GGUF")
    (d / "notes.txt").write_text("hello")
    write_mlx_folder(d / "tiny-mlx")
    (d / "empty").mkdir()
    # A file and a folder that answer to the same stem: the folder wins `twin`, so the
    # file is listed by its full name.
    shutil.copy(synth, d / "twin.gguf")
    write_mlx_folder(d / "twin")
    # A cached repo inside a --models folder is listed by its repo id.
    FakeHub(d, tmp_path).add("org/in-dir", ["m.Q4_K_M.gguf"])

    hub.add("org/one", ["one.Q4_K_M.gguf", "README.md"])
    hub.add("org/many", ["x.Q4_K_M.gguf", "x.Q8_0.gguf", "mmproj-x.gguf"])
    hub.add("org/split", ["Q8_0/s-00001-of-00002.gguf", "Q8_0/s-00002-of-00002.gguf"])
    hub.add("org/mlx", {"config.json": b"{}", "model.safetensors": b"\0" * 16})
    hub.add("org/docs", ["README.md"])  # no weights
    (hub.root / "models--org--partial" / "blobs").mkdir(parents=True)  # no snapshot yet
    (hub.root / "datasets--org--data" / "snapshots" / "r").mkdir(parents=True)

    outside = tmp_path / "elsewhere" / "given.gguf"
    outside.parent.mkdir()
    shutil.copy(synth, outside)
    # Names are resolved as a node would, not from wherever the caller stands.
    monkeypatch.chdir(tmp_path / "elsewhere")

    names = held_models([d], [str(outside), "no-such-model"])
    assert set(names) - set(local_models()) == {
        "solo", "big-00001-of-00002", "tiny-mlx", "twin", "twin.gguf", "org/in-dir",
        "org/one", "org/many:x.Q4_K_M.gguf", "org/many:x.Q8_0.gguf", "org/split",
        "org/mlx", str(outside),
    }  # fmt: skip
    assert names == sorted(names)
    roots = ModelRoots(dirs=[d], allowed=[str(outside)])
    paths = {name: roots.resolve(name) for name in names}
    assert Path(paths["solo"].path) == d / "solo.gguf"
    assert Path(paths["big-00001-of-00002"].path) == d / "big-00001-of-00002.gguf"
    assert (paths["tiny-mlx"].format, Path(paths["tiny-mlx"].path)) == ("mlx", d / "tiny-mlx")
    assert (paths["twin"].format, paths["twin.gguf"].format) == ("mlx", "gguf")
    assert paths["org/many:x.Q8_0.gguf"].path.endswith("x.Q8_0.gguf")
    assert paths["org/split"].path.endswith("Q8_0/s-00001-of-00002.gguf")
    assert paths["org/mlx"].format == "mlx"
    # No two names are one file.
    assert len({p.path for p in paths.values()}) == len(paths)


def test_held_models_stops_at_its_cap_and_says_so(
    tmp_path: Path, synth: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path / "models"
    d.mkdir()
    for i in range(6):
        shutil.copy(synth, d / f"m{i}.gguf")
    with caplog.at_level(logging.WARNING, logger="meshd.models"):
        names = held_models([d], limit=len(local_models()) + 3)
    assert len(names) == len(local_models()) + 3
    assert "only the first" in caplog.text
    # An unreadable or absent folder is no error: nothing is listed from it.
    assert held_models([tmp_path / "absent"]) == local_models()


def test_facts_of_a_name_under_a_models_dir_carry_its_sha256_hashed_once(
    tmp_path: Path, synth: Path
) -> None:
    d = tmp_path / "models"
    d.mkdir()
    shutil.copy(synth, d / "solo.gguf")
    cache = tmp_path / "cache"
    facts = read_model_facts("solo", cache, extra_dirs=[d])
    assert facts.name == "solo"
    assert facts.sha256 == hashlib.sha256((d / "solo.gguf").read_bytes()).hexdigest()
    # Cached by path, size and mtime: a second read hashes nothing (the cached facts
    # answer, even with the digest cache gone), a changed file is read again.
    st = (d / "solo.gguf").stat()
    key = f"{(d / 'solo.gguf').resolve()}|{st.st_size}|{st.st_mtime_ns}"
    assert key in json.loads((cache / "facts-v9.json").read_text())
    assert key in json.loads((cache / "sha256.json").read_text())
    (cache / "sha256.json").unlink()
    assert read_model_facts("solo", cache, extra_dirs=[d]).sha256 == facts.sha256
    assert not (cache / "sha256.json").exists()
    with open(d / "solo.gguf", "ab") as f:
        f.write(b"\0" * 32)
    changed = read_model_facts("solo", cache, extra_dirs=[d])
    assert changed.sha256 == hashlib.sha256((d / "solo.gguf").read_bytes()).hexdigest()
    assert changed.sha256 != facts.sha256

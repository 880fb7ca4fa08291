"""The sampling a model ships with: read from GGUF metadata and MLX folders, checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.domain.sampling import SamplingChoice
from meshd.models.facts import read_facts
from meshd.models.generation import folder_sampling, gguf_sampling
from tests.synthetic import write_model

pytestmark = pytest.mark.timeout(120)


def test_a_gguf_with_sampling_keys_carries_them_in_its_facts(
    model_path: Path, tmp_path: Path
) -> None:
    path = write_model(
        tmp_path / "tuned.gguf", model_path, "llama",
        metadata={"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                  "general.sampling.top_p": 0.8, "general.sampling.min_p": 0.1,
                  "general.sampling.penalty_repeat": 1.05,
                  "general.sampling.penalty_last_n": 128},
    )  # fmt: skip
    facts = read_facts(path, "tuned", cache_dir=tmp_path)
    s = facts.sampling
    assert s is not None
    assert (s.top_k, s.repeat_last_n) == (20, 128)
    assert s.temperature == pytest.approx(0.6)
    assert s.top_p == pytest.approx(0.8)
    assert s.min_p == pytest.approx(0.1)
    assert s.repeat_penalty == pytest.approx(1.05)
    assert facts.n_vocab == 49_152  # the default model's tokenizer
    # Served from the facts cache the second time, with the same answer.
    assert read_facts(path, "tuned", cache_dir=tmp_path) == facts


def test_the_default_model_ships_no_sampling(model_path: Path, tmp_path: Path) -> None:
    facts = read_facts(model_path, "smollm2", cache_dir=tmp_path)
    assert facts.sampling is None
    assert facts.n_vocab == 49_152


def test_insane_values_are_dropped_and_the_rest_kept() -> None:
    got = gguf_sampling({
        "general.sampling.temp": float("nan"),
        "general.sampling.top_k": -3,
        "general.sampling.top_p": 1.5,
        "general.sampling.min_p": 0.05,
        "general.sampling.penalty_repeat": "1.1",
    })  # fmt: skip
    assert got == SamplingChoice(min_p=0.05)
    assert gguf_sampling({"general.sampling.temp": True}) is None
    assert gguf_sampling({}) is None


def test_a_folder_ships_sampling_only_when_it_samples(tmp_path: Path) -> None:
    cfg = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
           "repetition_penalty": 1.05, "bos_token_id": 1}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    assert folder_sampling(tmp_path) == SamplingChoice(
        temperature=0.7, top_p=0.8, top_k=20, repeat_penalty=1.05
    )
    # Hugging Face ignores temperature and top-p without do_sample: so do we.
    (tmp_path / "generation_config.json").write_text(json.dumps({**cfg, "do_sample": False}))
    assert folder_sampling(tmp_path) is None
    (tmp_path / "generation_config.json").write_text("{not json")
    assert folder_sampling(tmp_path) is None
    assert folder_sampling(tmp_path / "absent") is None

"""``meshctl pull``: which files of a hub repo it fetches, and its clear errors when the
hub cannot be reached (these machines are offline: the download itself is not run
here; what follows it, a node finding the model in its HF cache, is in
tests/node/test_models_held.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from meshd.cli.pull import FOLDER_PATTERNS, PullError, choose_files, parse_spec

pytestmark = pytest.mark.timeout(60)


def meshctl_pull(spec: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", "pull", spec],
        capture_output=True, text=True, timeout=45, env={**os.environ, **env},
    )  # fmt: skip


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_is_a_clear_error_in_seconds_that_says_what_to_do() -> None:
    t0 = time.monotonic()
    r = meshctl_pull("org/model-GGUF:Q4_K_M", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    assert r.returncode == 1
    assert "cannot reach the Hugging Face Hub" in r.stderr
    assert "--models DIR" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 20


def test_offline_mode_is_said_and_nothing_is_tried() -> None:
    r = meshctl_pull("org/model-GGUF", HF_HUB_OFFLINE="1")
    assert r.returncode == 1 and "HF_HUB_OFFLINE is set" in r.stderr


def test_a_name_that_is_no_repo_id_is_refused() -> None:
    r = meshctl_pull("just-a-name")
    assert r.returncode == 1 and "not a Hugging Face repo id" in r.stderr
    assert parse_spec("org/x-GGUF:q4_k_m") == ("org/x-GGUF", "q4_k_m")
    assert parse_spec("org/x") == ("org/x", None)


GGUF_REPO = [
    "README.md", ".gitattributes",
    "x-Q8_0.gguf", "x-Q4_K_M.gguf", "x-Q6_K.gguf", "mmproj-x-f16.gguf",
    "big/x-Q5_K_M-00001-of-00002.gguf", "big/x-Q5_K_M-00002-of-00002.gguf",
]  # fmt: skip


def test_one_quantization_is_chosen_as_asked_or_by_preference() -> None:
    assert choose_files("o/x", GGUF_REPO, "Q6_K") == ["x-Q6_K.gguf"]
    assert choose_files("o/x", GGUF_REPO, "q8_0") == ["x-Q8_0.gguf"]
    assert choose_files("o/x", GGUF_REPO, None) == ["x-Q4_K_M.gguf"]  # Q4_K_M first
    assert choose_files("o/x", GGUF_REPO, "x-Q6_K.gguf") == ["x-Q6_K.gguf"]
    # A split model comes with every shard.
    assert choose_files("o/x", GGUF_REPO, "Q5_K_M") == [
        "big/x-Q5_K_M-00001-of-00002.gguf", "big/x-Q5_K_M-00002-of-00002.gguf",
    ]  # fmt: skip


def test_a_quantization_that_is_not_there_lists_the_files() -> None:
    with pytest.raises(PullError) as e:
        choose_files("o/x", GGUF_REPO, "IQ2_XS")
    assert "no file matches quantization 'IQ2_XS'" in str(e.value)
    assert "x-Q6_K.gguf" in str(e.value) and "mmproj" not in str(e.value)
    with pytest.raises(PullError) as e:
        choose_files("o/x", ["a-Q4_K_M.gguf", "b-Q4_K_M.gguf"], None)
    assert "several files match" in str(e.value)


def test_a_safetensors_repo_is_fetched_as_the_folder_an_mlx_stage_loads() -> None:
    files = ["config.json", "model.safetensors", "tokenizer.json", "README.md"]
    assert choose_files("o/m", files, None) == list(FOLDER_PATTERNS)
    with pytest.raises(PullError):
        choose_files("o/m", files, "Q4_K_M")
    with pytest.raises(PullError):
        choose_files("o/m", ["README.md"], None)

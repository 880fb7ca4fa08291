"""Fixtures the model tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.test_resolve import FakeHub


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """An empty Hugging Face hub cache, where ``HF_HUB_CACHE`` points for the test."""
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return FakeHub(root, tmp_path)

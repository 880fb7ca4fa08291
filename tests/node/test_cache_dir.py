"""Where a node keeps its cache: the platform's cache folder for the platform's own
data dir, inside any other data dir; an older meshd's cache is moved, not cut again."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshd.node.config import NodeConfig
from meshd.node.local import cache_dir_for, move_old_cache


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "MESHD_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("sys.platform", "linux")
    return tmp_path


def test_the_default_data_dir_caches_in_the_platforms_cache_folder(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert NodeConfig().cache_dir == home / ".cache" / "meshd"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "c"))
    assert cache_dir_for(home / ".local" / "share" / "meshd") == home / "c" / "meshd"
    monkeypatch.setattr("sys.platform", "darwin")
    assert cache_dir_for(home / "Library" / "Application Support" / "meshd") == (
        home / "Library" / "Caches" / "meshd"
    )


def test_a_data_dir_of_its_own_keeps_its_cache_inside(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two nodes on one machine, each on its own data dir, share no cache.
    assert cache_dir_for(home / "a") == home / "a" / "cache"
    monkeypatch.setenv("MESHD_DATA_DIR", str(home / "b"))
    assert NodeConfig().cache_dir == home / "b" / "cache"


def test_an_older_cache_moves_once_and_a_newer_one_is_kept(home: Path) -> None:
    data = home / ".local" / "share" / "meshd"
    (data / "cache" / "abc").mkdir(parents=True)
    (data / "cache" / "abc" / "0-10.gguf").write_bytes(b"slice")
    new = cache_dir_for(data)
    assert move_old_cache(data, new)
    assert (new / "abc" / "0-10.gguf").read_bytes() == b"slice"
    assert not (data / "cache").exists()
    # A cache at the new place is never overwritten by an old one.
    (data / "cache").mkdir()
    assert not move_old_cache(data, new)
    assert (data / "cache").is_dir() and (new / "abc").is_dir()
    # Inside a data dir of its own, there is nothing to move.
    assert not move_old_cache(home / "x", cache_dir_for(home / "x"))

"""What a data dir gives away to another user of the machine: nothing.

In-process, on real files: the modes meshd leaves, and that ``cluster.json`` holds no
fast test of the cluster secret (an older one that did is upgraded in place).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

import meshd.node.cluster_store as cluster_store
from meshd.node.cluster_store import ClusterStore
from meshd.node.identity import load_identity
from meshd.transport.security import cluster_key_from_secret, write_private

SECRET = "correct horse battery staple, twice"

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX modes")


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _others_read_nothing(data_dir: Path) -> None:
    assert _mode(data_dir) == 0o700
    for p in data_dir.iterdir():
        assert _mode(p) & 0o077 == 0, (p.name, oct(_mode(p)))


def test_a_new_data_dir_and_its_files_are_this_users_alone(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        data_dir = tmp_path / "new" / "meshd"
        ident = load_identity(data_dir)
        try:
            ClusterStore(data_dir).from_secret(SECRET, "home")
        finally:
            ident.release()
    finally:
        os.umask(old)
    assert {p.name for p in data_dir.iterdir()} >= {"cluster.json", "cluster.key", "node.key"}
    _others_read_nothing(data_dir)


def test_an_old_data_dir_is_tightened_and_its_fast_fingerprint_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As meshd left it before: a 0755 dir, a 0644 cluster.json with an unsalted hash of
    # the secret that tests a guess in a microsecond.
    data_dir = tmp_path / "meshd"
    data_dir.mkdir(mode=0o755)
    os.chmod(data_dir, 0o755)
    key = cluster_key_from_secret(SECRET)
    write_private(data_dir / "cluster.key", key)
    fast = hashlib.blake2b(SECRET.encode(), digest_size=16, person=b"meshd-secret").hexdigest()
    state = data_dir / "cluster.json"
    state.write_text(json.dumps({"id": "x", "name": "home", "secret_fp": fast, "members": ""}))
    os.chmod(state, 0o644)

    derived: list[str] = []

    def counting(secret: str) -> bytes:
        derived.append(secret)
        return cluster_key_from_secret(secret)

    monkeypatch.setattr(cluster_store, "cluster_key_from_secret", counting)
    ident = load_identity(data_dir)
    try:
        _others_read_nothing(data_dir)
        store = ClusterStore(data_dir)
        assert store.from_secret(SECRET, "home").key == key
        assert len(derived) == 1  # the old fingerprint is not trusted: derived once
        text = state.read_text()
        assert fast not in text and "secret_fp" not in text
        assert _mode(state) == 0o600
        # The next start is fast again: no derivation while the secret is the same...
        assert store.from_secret(SECRET, "home").key == key
        store.save_members([])  # (a save keeps what lets it skip the derivation)
        assert store.from_secret(SECRET + "\n", "home").key == key
        assert len(derived) == 1
        # ...and the stored value tests no guess without cluster.key: a MAC under it.
        mac = json.loads(state.read_text())["secret_mac"]
        assert mac == cluster_store.secret_mac(key, SECRET)
        assert mac != cluster_store.secret_mac(bytes(32), SECRET)
        # Another secret is another cluster: derived, not taken from the MAC.
        other = store.from_secret(SECRET + " and more", "home")
        assert len(derived) == 2 and other.key != key
    finally:
        ident.release()

"""What a node keeps of its cluster on disk, in its data dir.

* ``cluster.key`` (0600): the cluster key, 32 bytes. Its holders derive the sockets'
  server keys and may vouch for a new member (a proof). Made by the first node of a
  cluster, handed to each node it admits; or derived from a secret file.
* ``cluster.json`` (0600): the cluster's id (a hash of the key), its name, the member
  entries this node holds (so that a restarted node admits its peers before it hears
  from any of them), and ``secret_mac``: an HMAC of the secret the key came from,
  keyed by the cluster key itself.

``secret_mac`` lets a restart skip the slow Argon2id derivation when the secret has not
changed, without leaving a fast offline test of the secret on disk: checking a guess
needs ``cluster.key``, and whoever holds that holds what the secret guards. (Before,
``secret_fp`` was an unsalted BLAKE2b of the secret: 1.3 M guesses/s against
``cluster.json`` alone. A file that still has one is derived once and rewritten.)

Nothing here is read from the network: a node learns its cluster at its own start or
through the join protocol (:mod:`meshd.node.joining`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from meshd.crdt.lww import Entry
from meshd.transport.security import (
    cluster_id_of,
    cluster_key_from_secret,
    read_private,
    write_private,
)

__all__ = ["KEY_FILE", "STATE_FILE", "ClusterStore", "StoredCluster", "secret_mac"]

log = logging.getLogger("meshd.node")

KEY_FILE = "cluster.key"
STATE_FILE = "cluster.json"

_entries = msgspec.msgpack.Decoder(list[Entry])
_encoder = msgspec.msgpack.Encoder()


@dataclass
class StoredCluster:
    """A cluster this node belongs to."""

    key: bytes
    name: str
    members: list[Entry] = field(default_factory=list)
    #: A secret-file cluster: holders of the key vouch for themselves as members.
    #: Elsewhere the key grants nothing: only an approval makes a member.
    self_vouch: bool = False

    @property
    def id(self) -> str:
        """The cluster's public id."""
        return cluster_id_of(self.key)


class ClusterStore:
    """The two files of one data dir."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.key_file = data_dir / KEY_FILE
        self.state_file = data_dir / STATE_FILE

    def load(self) -> StoredCluster | None:
        """The cluster this node belongs to, or None (a new node)."""
        try:
            key = read_private(self.key_file)
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None
        if len(key) != 32 or not isinstance(state, dict):
            return None
        try:
            members = _entries.decode(base64.b64decode(state.get("members", "")))
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
            members = []
        # Data dirs from before the flag: a secret-file cluster is one with a secret's fp.
        vouch = state.get("self_vouch", bool(state.get("secret_fp") or state.get("secret_mac")))
        return StoredCluster(
            key=key, name=str(state.get("name", "")), members=members, self_vouch=bool(vouch)
        )

    def save(self, cluster: StoredCluster, *, secret_mac: str = "") -> None:
        """Write both files, 0600 (the key only if it changed); ``secret_mac``: see
        :meth:`from_secret` (empty: the one on disk is kept, if it is for this key)."""
        try:
            same = read_private(self.key_file) == cluster.key
        except OSError:
            same = False
        if not same:
            write_private(self.key_file, cluster.key, replace=self.key_file.exists())
        state = {
            "id": cluster.id,
            "name": cluster.name,
            "secret_mac": secret_mac or (self._field("secret_mac") if same else ""),
            "self_vouch": cluster.self_vouch,
            "members": base64.b64encode(_encoder.encode(cluster.members)).decode(),
        }
        # write_private: a new 0600 file renamed over the old one, so a cluster.json
        # left 0644 by an older meshd is tightened by the first save.
        write_private(self.state_file, json.dumps(state).encode(), replace=True)

    def save_members(self, members: list[Entry]) -> None:
        """Record the member entries the node holds now."""
        cluster = self.load()
        if cluster is not None:
            cluster.members = members
            self.save(cluster)

    def from_secret(self, secret: str, name: str) -> StoredCluster:
        """The cluster a secret file stands for: its key derived (slowly, so only when
        the secret changed since the last start), members kept from the last run."""
        stored = self.load()
        if stored is not None:
            mac = self._field("secret_mac")
            if mac and hmac.compare_digest(mac, secret_mac(stored.key, secret)):
                stored.name, stored.self_vouch = name, True
                return stored
        key = cluster_key_from_secret(secret)
        cluster = StoredCluster(key=key, name=name, self_vouch=True)
        if stored is not None and stored.key == key:
            cluster.members = stored.members
        self.save(cluster, secret_mac=secret_mac(key, secret))
        return cluster

    def _field(self, name: str) -> str:
        try:
            return str(json.loads(self.state_file.read_text()).get(name, ""))
        except (OSError, ValueError, AttributeError):
            return ""


def secret_mac(cluster_key: bytes, secret: str) -> str:
    """What ``cluster.json`` keeps of the secret: a MAC keyed by the cluster key it
    stands for (so testing a guess against it needs ``cluster.key``). The secret is
    stripped as :func:`cluster_key_from_secret` strips it."""
    raw = secret.encode().strip()
    return hashlib.blake2b(
        raw, key=cluster_key, digest_size=16, person=b"meshd-secret-mac"
    ).hexdigest()

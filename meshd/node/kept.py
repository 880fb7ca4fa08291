"""The placements a node keeps in its data dir, so that a whole-house restart (a power
cut) brings them back as they were.

``placements.json`` (0600) holds the instances the node knows, each as its id, its spec
(what the owner asked: context, KV cache type, pins, exclusions, speculation, draft)
and ``placed``: the clock of the write that first placed it, which its repairs keep.
It also holds the removals the node has seen: id -> the ``placed`` of the instance
removed.

* **Restore.** After a start, once the first peers have had ``settle_s`` to answer, the
  node places anew, over the nodes present, each kept instance the cluster holds no
  entry for (:meth:`Instances.restore <meshd.node.instances.Instances.restore>`), under
  its own id and ``placed``. One that does not fit yet waits for more nodes.
* **Removal is for good.** A tombstone newer than a kept instance's ``placed`` removes
  it from the file and records the removal. A node that holds the removal deletes any
  instance that is the one removed (its id and a ``placed`` no newer): one that a node
  offline at the removal placed again from its own file. A later placement under the
  same id (an automatic one: :func:`~meshd.node.instances.auto_instance_id`) is newer
  and stays.

:func:`observe` and :func:`stale` are pure; :class:`PlacementsFile` is the file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

import msgspec

from meshd.crdt.lww import Entry
from meshd.crdt.views import INSTANCE, Instance, InstanceSpec, decode, instance_key
from meshd.transport.secret_files import write_private

from .state import ClusterState

__all__ = [
    "PLACEMENTS_FILE",
    "Kept",
    "KeptInstance",
    "KeptPlacements",
    "PlacementsFile",
    "observe",
    "stale",
]

log = logging.getLogger("meshd.node")

PLACEMENTS_FILE = "placements.json"
#: Removals remembered (the newest); a node offline longer than this many removals
#: ago may bring back an instance removed before them.
MAX_REMOVED = 1024
#: Seconds between two writes of the file (a burst of changes is one write).
SAVE_EVERY_S = 1.0


class KeptInstance(msgspec.Struct, frozen=True, kw_only=True):
    """An instance as the file keeps it: enough to place it again."""

    id: str
    spec: InstanceSpec
    #: The clock of its first placement (0: placed by a meshd from before it was kept).
    placed: int = 0


class Kept(msgspec.Struct, kw_only=True):
    """What the file holds."""

    instances: dict[str, KeptInstance] = {}
    #: Instance id -> the ``placed`` of the newest instance of that id removed.
    removed: dict[str, int] = {}


def observe(kept: Kept, entries: Iterable[Entry]) -> Kept:
    """``kept`` with what the map's instance entries (live and tombstones) say now.

    A live instance is kept (unless it is one removed: see :func:`stale`); a tombstone
    newer than a kept instance's ``placed`` removes it and records the removal, and so
    does a live entry of the same id placed later (the old one was removed between).
    An id with no entry at all stays kept: after a restart, it is what is restored.
    """
    instances, removed = dict(kept.instances), dict(kept.removed)

    def remove(k: KeptInstance) -> None:
        instances.pop(k.id, None)
        removed[k.id] = max(removed.get(k.id, 0), k.placed)

    for e in entries:
        iid = e.key[len(INSTANCE) :]
        old = instances.get(iid)
        if e.value is None:
            if old is not None and e.hlc > old.placed:
                remove(old)
            continue
        inst = decode(e.value, Instance)
        if inst is None or inst.id != iid or _is_removed(removed, inst):
            continue
        if old is not None and old.placed < inst.placed:
            remove(old)
        if old is None or old.placed <= inst.placed:
            instances[iid] = KeptInstance(id=iid, spec=inst.spec, placed=inst.placed)
    if len(removed) > MAX_REMOVED:
        removed = dict(sorted(removed.items(), key=lambda kv: kv[1])[-MAX_REMOVED:])
    return Kept(instances=instances, removed=removed)


def stale(kept: Kept, live: Iterable[Instance]) -> list[str]:
    """Ids of the ``live`` instances that are ones removed (to delete again)."""
    return [i.id for i in live if _is_removed(kept.removed, i)]


def _is_removed(removed: dict[str, int], inst: Instance) -> bool:
    return 0 < inst.placed <= removed.get(inst.id, 0)


class PlacementsFile:
    """``placements.json`` in one data dir."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / PLACEMENTS_FILE

    def load(self) -> Kept:
        """What the file holds; empty when there is none or it cannot be read (said)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return Kept()
        except OSError as e:
            log.warning("placements kept in %s cannot be read (%s): none restored", self.path, e)
            return Kept()
        try:
            return msgspec.json.decode(raw, type=Kept)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("placements kept in %s are not valid (%s): none restored", self.path, e)
            return Kept()

    def save(self, kept: Kept) -> None:
        """Write the file (a new one renamed over the old)."""
        write_private(self.path, msgspec.json.encode(kept), replace=True)


class KeptPlacements:
    """The node's kept placements: the file, brought up to date as the cluster's
    instances change (written at most every :data:`SAVE_EVERY_S`)."""

    def __init__(self, data_dir: Path, state: ClusterState) -> None:
        self.file = PlacementsFile(data_dir)
        self.state = state
        #: As loaded: the restore places these (the map learns the cluster's first).
        self.kept = self.file.load()
        self._dirty = asyncio.Event()

    def changed(self) -> None:
        """The instance entries changed: take what they say, and delete again any that
        is an instance removed."""
        entries = (e for e in self.state.map.entries() if e.key.startswith(INSTANCE))
        self.kept = observe(self.kept, entries)
        for iid in stale(self.kept, self.state.view().instances.values()):
            log.warning("instance %s was removed: deleting the copy placed again", iid)
            self.state.delete(instance_key(iid))
        self._dirty.set()

    def pending(self) -> list[KeptInstance]:
        """The kept instances the cluster holds no entry for (live or removed)."""
        m = self.state.map
        return [k for k in self.kept.instances.values() if m.get(instance_key(k.id)) is None]

    async def run(self) -> None:
        """Write the file after changes, at most every :data:`SAVE_EVERY_S`."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await asyncio.to_thread(self.file.save, self.kept)
            except OSError as e:
                log.warning("cannot keep the placements in %s: %s", self.file.path, e)
            await asyncio.sleep(SAVE_EVERY_S)

"""Last-writer-wins map with tombstones, bucketed digests and a safe GC rule.

Every shared fact is an :class:`Entry` ``key -> (value, hlc, writer)``. Merge keeps the
entry that is larger in the total order ``(hlc, writer, is_tombstone, value)``, so merge
is commutative, associative and idempotent whatever the delivery order.

Anti-entropy: keys fall into :data:`N_BUCKETS` buckets (crc32 of the key); a bucket's
hash is the XOR of its entries' 64-bit hashes, kept up to date on every merge in O(1).
Two replicas compare their bucket hashes and exchange only the buckets that differ.

Tombstone collection (see :meth:`LWWMap.collect`): a tombstone is dropped only below a
*stable horizon* that every member has provably synced past, and the map then refuses any
entry below that horizon, for a key it does not hold, *written by one of those members*.
Such an entry can only be a stale copy of something deleted and collected, so deleted
data cannot come back. An entry written by a node that was never a member when the
horizon moved is news (a node that ran on its own and joins now), never a stale copy,
so the horizon does not refuse it.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import cast

import msgspec

N_BUCKETS = 32
_MASK64 = (1 << 64) - 1


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One LWW register. ``value is None`` marks a tombstone.

    ``sig`` is the writer's signature of the other fields (empty in an open cluster);
    it is not part of the order nor of the content hash: a signature is deterministic,
    so one entry has one.
    """

    key: str
    hlc: int
    writer: str
    value: bytes | None = None
    sig: bytes = b""

    @property
    def is_tombstone(self) -> bool:
        """True when this entry records a delete."""
        return self.value is None

    def order(self) -> tuple[int, str, int, bytes]:
        """The total order merge uses: later clock wins, then writer id, then content.

        The last two only matter if one writer ever stamped two values with one clock
        (a duplicated node id); they keep merge deterministic even then.
        """
        tomb = 1 if self.value is None else 0
        return (self.hlc, self.writer, tomb, self.value or b"")


def entry_hash(e: Entry) -> int:
    """A 64-bit content hash of an entry (key, clock, writer and value)."""
    # Key and writer are length-prefixed so that no two distinct entries feed the hash
    # the same bytes (a writer id ending in b"\x01x" must not read as a value b"x").
    key, writer = e.key.encode(), e.writer.encode()
    h = hashlib.blake2b(digest_size=8)
    h.update(len(key).to_bytes(4, "big"))
    h.update(key)
    h.update(e.hlc.to_bytes(8, "big", signed=False))
    h.update(len(writer).to_bytes(4, "big"))
    h.update(writer)
    h.update(b"\x00" if e.value is None else b"\x01" + e.value)
    return int.from_bytes(h.digest(), "big")


def bucket_of(key: str) -> int:
    """Bucket index of a key: stable across processes and machines."""
    return zlib.crc32(key.encode()) % N_BUCKETS


def wins(new: Entry, old: Entry | None) -> bool:
    """True if ``new`` beats ``old`` under the LWW order."""
    return old is None or new.order() > old.order()


class LWWMap:
    """A replica of the cluster's shared state. Pure: no clocks, no I/O."""

    # __weakref__: readers may keep what they derived from a map for as long as it lives
    # (meshd.crdt.views decodes each entry once).
    __slots__ = (
        "__weakref__", "_buckets", "_entries", "covered", "horizon", "rejected_below_horizon",
    )  # fmt: skip

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._entries: dict[str, Entry] = {}
        self._buckets: list[int] = [0] * N_BUCKETS
        #: Entries with ``hlc < horizon`` by a writer in :attr:`covered` are refused for
        #: keys this map does not hold.
        self.horizon = 0
        #: Writers that were members when the horizon moved (grow-only). Their entries
        #: below the horizon were held by every member, so one we lack was collected.
        self.covered: set[str] = set()
        #: How many entries the horizon rule refused (stale copies of collected data).
        self.rejected_below_horizon = 0
        for e in entries:
            self.merge(e)

    # -- reading -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        e = self._entries.get(cast(str, key))  # a key of any other type is absent
        return e is not None and e.value is not None

    def get(self, key: str) -> Entry | None:
        """The entry for ``key``, tombstones included."""
        return self._entries.get(key)

    def value(self, key: str) -> bytes | None:
        """The live value for ``key``, or None if absent or deleted."""
        e = self._entries.get(key)
        return None if e is None else e.value

    def entries(self) -> Iterator[Entry]:
        """Every entry, tombstones included."""
        return iter(self._entries.values())

    def live(self, prefix: str = "") -> Iterator[Entry]:
        """Entries that are not tombstones, optionally under a key prefix."""
        for k, e in self._entries.items():
            if e.value is not None and k.startswith(prefix):
                yield e

    def tombstones(self) -> Iterator[Entry]:
        """Entries that record a delete."""
        return (e for e in self._entries.values() if e.value is None)

    # -- writing -------------------------------------------------------------------
    def below_horizon(self, e: Entry) -> bool:
        """True if the horizon rule refuses ``e``: a key this map does not hold, a clock
        below the horizon, and a writer the horizon covers (so every member held ``e``
        or something newer, and lacking it means it was deleted and collected)."""
        return e.hlc < self.horizon and e.key not in self._entries and e.writer in self.covered

    def merge(self, e: Entry, *, exempt: bool = False) -> bool:
        """Fold one entry in. Return True if the state changed.

        ``exempt`` skips the horizon rule, for entries the caller knows cannot be stale
        copies of collected data (a node's own card, written by that node).
        """
        old = self._entries.get(e.key)
        if not exempt and old is None and self.below_horizon(e):
            self.rejected_below_horizon += 1
            return False
        if not wins(e, old):
            return False
        b = bucket_of(e.key)
        if old is not None:
            self._buckets[b] ^= entry_hash(old)
        self._buckets[b] ^= entry_hash(e)
        self._entries[e.key] = e
        return True

    def merge_many(self, entries: Iterable[Entry]) -> list[Entry]:
        """Fold entries in; return those that changed the state (the delta to pass on)."""
        return [e for e in entries if self.merge(e)]

    def put(self, key: str, value: bytes, hlc: int, writer: str) -> Entry:
        """Write a value with a caller-supplied clock; return the entry to gossip."""
        e = Entry(key, hlc, writer, value)
        self.merge(e)
        return e

    def delete(self, key: str, hlc: int, writer: str) -> Entry:
        """Write a tombstone with a caller-supplied clock; return the entry to gossip."""
        e = Entry(key, hlc, writer, None)
        self.merge(e)
        return e

    # -- anti-entropy ----------------------------------------------------------------
    def digest(self) -> tuple[int, ...]:
        """Per-bucket hashes: a compact summary two replicas compare."""
        return tuple(self._buckets)

    def root(self) -> int:
        """One hash of the whole state (XOR of the bucket hashes)."""
        r = 0
        for b in self._buckets:
            r ^= b
        return r & _MASK64

    def differing_buckets(self, remote: tuple[int, ...] | list[int]) -> list[int]:
        """Indices of buckets whose hash differs from a remote digest."""
        if len(remote) != N_BUCKETS:
            raise ValueError(f"digest must have {N_BUCKETS} buckets, got {len(remote)}")
        return [i for i, (a, b) in enumerate(zip(self._buckets, remote, strict=True)) if a != b]

    def diff(self, remote: tuple[int, ...] | list[int]) -> list[Entry]:
        """Entries in every bucket where a remote digest differs from ours."""
        wanted = set(self.differing_buckets(remote))
        if not wanted:
            return []
        return [e for k, e in self._entries.items() if bucket_of(k) in wanted]

    def diff_page(
        self,
        remote: tuple[int, ...] | list[int] | None,
        after: tuple[int, str] | None = None,
        budget: int = 1 << 20,
    ) -> tuple[list[Entry], tuple[int, str] | None]:
        """One page of :meth:`diff` (``remote`` None: of every entry), in (bucket, key)
        order, starting past the cursor ``after``, about ``budget`` bytes; and the
        cursor to ask for the next page with (None: nothing is left)."""
        wanted = None if remote is None else set(self.differing_buckets(remote))
        keyed = sorted(
            ((bucket_of(k), k), e) for k, e in self._entries.items()
            if wanted is None or bucket_of(k) in wanted
        )  # fmt: skip
        return page(keyed, after, budget)

    def version_vector(self) -> dict[str, int]:
        """Largest clock held from each writer."""
        vv: dict[str, int] = {}
        for e in self._entries.values():
            if e.hlc > vv.get(e.writer, -1):
                vv[e.writer] = e.hlc
        return vv

    def since(self, vv: Mapping[str, int]) -> list[Entry]:
        """Entries newer than a version vector: the delta a replica at ``vv`` lacks,
        provided it received every writer's entries in order (gossip does not promise
        that, which is why anti-entropy works on digests)."""
        return [e for e in self._entries.values() if e.hlc > vv.get(e.writer, -1)]

    # -- tombstone collection ------------------------------------------------------
    def collect(self, stable: int, members: Iterable[str], keep: tuple[str, ...] = ()) -> int:
        """Drop tombstones older than ``stable``, but for keys starting with one of
        ``keep`` (deletes that must outlive any stale copy: a removed member); return
        how many were dropped.

        ``stable`` must be a horizon that every one of ``members`` has synced past: each
        holds every entry any member wrote before it (see :func:`stable_horizon`). Then
        every member holds the tombstone or something newer, so no member can push the
        deleted value back. The map refuses, from then on, entries below the horizon for
        keys it does not hold written by a covered writer (``members`` joins
        :attr:`covered`): those can only be stale copies of collected data, brought back
        by a node that was away (gone for good, then back with stale state). A writer
        never covered was not part of the agreement: its old entries are news.
        """
        if stable <= self.horizon:
            return 0
        self.horizon = stable
        self.covered.update(members)
        dead = [
            k for k, e in self._entries.items()
            if e.value is None and e.hlc < stable and not k.startswith(keep)
        ]  # fmt: skip
        for k in dead:
            e = self._entries.pop(k)
            self._buckets[bucket_of(k)] ^= entry_hash(e)
        return len(dead)

    def copy(self) -> LWWMap:
        """An independent replica with the same state."""
        m = LWWMap()
        m._entries = dict(self._entries)
        m._buckets = list(self._buckets)
        m.horizon = self.horizon
        m.covered = set(self.covered)
        return m

    def same_state(self, other: LWWMap) -> bool:
        """True if both replicas hold exactly the same entries."""
        return self._entries == other._entries


def entry_size(e: Entry) -> int:
    """About how many bytes ``e`` takes on the wire (for paging)."""
    return len(e.key) + len(e.writer) + len(e.value or b"") + len(e.sig) + 24


def page(
    keyed: list[tuple[tuple[int, str], Entry]],
    after: tuple[int, str] | None,
    budget: int,
) -> tuple[list[Entry], tuple[int, str] | None]:
    """The entries of ``keyed`` (sorted by cursor) past ``after``, up to ``budget``
    bytes (at least one), and the cursor of the last one taken if any is left."""
    out: list[Entry] = []
    size = 0
    for i, (cursor, e) in enumerate(keyed):
        if after is not None and cursor <= after:
            continue
        n = entry_size(e)
        if out and size + n > budget:
            return out, keyed[i - 1][0]
        out.append(e)
        size += n
    return out, None


def stable_horizon(synced: Mapping[str, int]) -> int:
    """The GC horizon of a cluster: the smallest ``synced`` clock over all members.

    ``synced[m]`` is what member ``m`` publishes: a clock ``t`` such that ``m`` has
    pulled, from every other member ``p``, all of ``p``'s state as of ``p``'s clock
    ``t`` or later. The minimum over members is a time before which every member holds
    every entry. No members, no horizon (0).
    """
    return min(synced.values(), default=0)

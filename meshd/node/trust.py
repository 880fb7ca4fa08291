"""What a node takes from the network: the rules every remote entry passes before the
LWW merge sees it (``meshd.crdt.replica.Trust``), and the keys its sockets admit.

Pure functions of the entry and the state held, so every node judges an entry alike:

* **Shape**: a key of a known key space with a plain id (letters, digits, ``._-``, at
  most 64), a value under its key space's size cap (``bad_key``, ``oversized``).
* **Signature**: the writer must be a member, and the entry signed by the key of its
  member entry (``not_member``, ``bad_signature``). Ownership of ``node/X`` and
  ``health/X`` is then checked against an authenticated writer.
* **Members**: ``member/X`` names the key whose id is X (``bad_member``); it is taken
  from a member (an approval), or, in a secret-file cluster only, from X itself with a
  proof made with the cluster key (elsewhere a kept key mints nothing: ``not_member``).
* **Owners**: only an owner removes a member (a member may remove itself), makes an
  owner, or rewrites another member's entry (``not_owner``). A removal is for good: the
  tombstone is never collected, and X cannot vouch for itself past it (``revoked``);
  only an owner's approval lets X in again.
* **Values**: a card or heartbeat that does not decode as one (``bad_value``).
* **Bounds**: a writer holds at most :data:`MAX_INSTANCES_PER_WRITER` live instances
  (``too_many``); the plans themselves are checked by :class:`PlanCheck` when given.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable

from meshd.crdt.lww import Entry, LWWMap
from meshd.crdt.views import (
    HEALTH,
    INSTANCE,
    MEMBER,
    NODE,
    Health,
    Member,
    NodeCard,
    decode,
    member_key,
)
from meshd.transport.identity import curve_public_of, member_proof, node_id_of, verify_entry

__all__ = [
    "KEY_RE",
    "MAX_INSTANCES_PER_WRITER",
    "VALUE_CAPS",
    "ClusterTrust",
    "is_owner",
    "member_by_ref",
    "member_curves",
    "member_entries",
    "revoked",
]

#: A key: a known key space, then an id of at most 64 plain characters.
KEY_RE = re.compile(r"^(node|health|instance|member)/[A-Za-z0-9._-]{1,64}$")
#: Largest value per key space (bytes): a card with the facts of dozens of models, a
#: heartbeat with dozens of runners, a plan of a model with thousands of layers.
VALUE_CAPS = {NODE: 128 << 10, HEALTH: 64 << 10, INSTANCE: 512 << 10, MEMBER: 4 << 10}
#: What a value of a key space must decode as (plans are checked by ``PlanCheck``).
_SHAPES: dict[str, type[NodeCard] | type[Health]] = {NODE: NodeCard, HEALTH: Health}
#: Live instances one writer may hold (placing a model is rare; a flood is not).
MAX_INSTANCES_PER_WRITER = 256

#: Why an instance entry is refused, or None (see ``meshd.node.plans``).
PlanCheck = Callable[[Entry, LWWMap], "str | None"]


def _member(m: LWWMap, nid: str) -> Member | None:
    v = m.value(member_key(nid))
    return None if v is None else decode(v, Member)


def revoked(m: LWWMap, nid: str) -> bool:
    """Whether ``nid`` was removed by another member (its entry's tombstone holds)."""
    e = m.get(member_key(nid))
    return e is not None and e.value is None and e.writer != nid


def is_owner(m: LWWMap, x: Member) -> bool:
    """Whether member ``x`` may remove members and make owners: it is marked so, or it
    vouched for itself with a secret file's key (holding the secret is ownership), or
    the cluster predates owners (none is marked: every member counts as one)."""
    if x.owner or (x.proof and x.by == x.id):
        return True
    return not any(_marked_owner(e) for e in m.live(MEMBER))


def _marked_owner(e: Entry) -> bool:
    x = decode(e.value or b"", Member)
    return x is not None and x.owner


def member_by_ref(held: dict[str, Member], ref: str) -> Member:
    """The member ``ref`` names: its id or name, else a unique id prefix (4+ characters).
    Raises LookupError naming the members when none or several match."""
    hits = [x for x in held.values() if ref in (x.id, x.name)]
    if not hits and len(ref) >= 4:
        hits = [x for x in held.values() if x.id.startswith(ref)]
    if len(hits) != 1:
        names = ", ".join(f"{x.name} ({x.id})" for x in held.values())
        raise LookupError(f"{'several members' if hits else 'no member'} match {ref!r}; "
                          f"members: {names}")  # fmt: skip
    return hits[0]


def member_entries(m: LWWMap) -> list[Entry]:
    """Every member entry held, removals included (what a node keeps and hands on)."""
    return [e for e in m.entries() if e.key.startswith(MEMBER)]


def member_curves(m: LWWMap) -> dict[str, bytes]:
    """Member id -> its CurveZMQ key (Z85): what the ZAP handlers admit, and the key a
    socket dialling that member names."""
    out = {}
    for e in m.live(MEMBER):
        x = decode(e.value or b"", Member)
        if x is not None and len(x.key) == 32:
            out[x.id] = curve_public_of(x.key)
    return out


class ClusterTrust:
    """The trust rules of one node's replica. With no cluster key (an open cluster) only
    the shape and the bounds are checked: there are no members and no signatures."""

    def __init__(
        self,
        cluster_key: bytes | None,
        plans: PlanCheck | None = None,
        *,
        self_vouch: bool = False,
    ) -> None:
        self._cluster_key = cluster_key
        self._plans = plans
        #: A secret-file cluster: holders of the key may vouch for themselves.
        self._self_vouch = self_vouch

    def refusal(self, e: Entry, m: LWWMap) -> str | None:
        """Why ``e`` is refused given the state ``m``, or None to take it."""
        if not KEY_RE.match(e.key):
            return "bad_key"
        space = e.key[: e.key.index("/") + 1]
        if e.value is not None and len(e.value) > VALUE_CAPS[space]:
            return "oversized"
        if self._cluster_key is None:
            if space == MEMBER:
                return "bad_key"  # an open cluster has no members
            return "too_many" if self._too_many(e, m) else None
        if space == MEMBER:
            return self._member_entry(e, m)
        writer = _member(m, e.writer)
        if writer is None:
            return "not_member"
        if not verify_entry(writer.key, e):
            return "bad_signature"
        if self._too_many(e, m):
            return "too_many"
        shape = _SHAPES.get(space)
        if shape is not None and e.value is not None and decode(e.value, shape) is None:
            return "bad_value"  # a card or heartbeat no node could read (a bad sha256...)
        if space == INSTANCE and e.value is not None and self._plans is not None:
            return self._plans(e, m)
        return None

    def _member_entry(self, e: Entry, m: LWWMap) -> str | None:
        nid = e.key[len(MEMBER) :]
        writer = _member(m, e.writer)
        if e.value is None:  # a removal: an owner's, or a member leaving
            if writer is None:
                return "not_member"
            if not verify_entry(writer.key, e):
                return "bad_signature"
            return None if e.writer == nid or is_owner(m, writer) else "not_owner"
        x = decode(e.value, Member)
        if x is None or x.id != nid or len(x.key) != 32 or node_id_of(x.key) != nid:
            return "bad_member"
        if writer is not None:  # an approval, or a member re-stamping itself
            if not verify_entry(writer.key, e):
                return "bad_signature"
            if self._may_write(m, writer, x):
                return None
            if e.writer == nid and x.proof and self._self_vouch:
                return self._vouched(e, m, x)  # a secret's holder re-stamping itself
            return "not_owner"
        return self._vouched(e, m, x)

    @staticmethod
    def _may_write(m: LWWMap, writer: Member, x: Member) -> bool:
        """An owner writes any member entry; any member approves a new node or re-stamps
        its own entry, without making anyone an owner."""
        if is_owner(m, writer):
            return True
        held = _member(m, x.id)
        if x.owner and not (held is not None and held.owner and x.id == writer.id):
            return False
        if x.id == writer.id:
            return True
        return held is None and not revoked(m, x.id)

    def _vouched(self, e: Entry, m: LWWMap, x: Member) -> str | None:
        """A node vouching for itself with the cluster key (a secret-file cluster)."""
        nid = x.id
        if e.writer != nid or not x.proof or not self._self_vouch:
            return "not_member"
        key = self._cluster_key
        if key is None or not hmac.compare_digest(x.proof, member_proof(key, x.key)):
            return "bad_member"
        if revoked(m, nid):
            return "revoked"
        return None if verify_entry(x.key, e) else "bad_signature"

    @staticmethod
    def _too_many(e: Entry, m: LWWMap) -> bool:
        """A new instance from a writer that holds its share of them already."""
        if not e.key.startswith(INSTANCE) or e.value is None or e.key in m:
            return False
        held = sum(1 for x in m.live(INSTANCE) if x.writer == e.writer)
        return held >= MAX_INSTANCES_PER_WRITER

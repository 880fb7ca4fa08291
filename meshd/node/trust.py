"""What a node takes from the network: the rules every remote entry passes before the
LWW merge sees it (``meshd.crdt.replica.Trust``), and the keys its sockets admit.

Pure functions of the entry and the state held, so every node judges an entry alike:

* **Shape**: a key of a known key space with a plain id (letters, digits, ``._-``, at
  most 64), a value under its key space's size cap (``bad_key``, ``oversized``).
* **Signature**: the writer must be a member, and the entry signed by the key of its
  member entry (``not_member``, ``bad_signature``). Ownership of ``node/X`` and
  ``health/X`` is then checked against an authenticated writer.
* **Members**: ``member/X`` names the key whose id is X; it is taken from a member (an
  approval), or from X itself with a proof made with the cluster key (``bad_member``).
* **Bounds**: a writer holds at most :data:`MAX_INSTANCES_PER_WRITER` live instances
  (``too_many``); the plans themselves are checked by :class:`PlanCheck` when given.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable

from meshd.crdt.lww import Entry, LWWMap
from meshd.crdt.views import HEALTH, INSTANCE, MEMBER, NODE, Member, decode, member_key
from meshd.transport.identity import curve_public_of, member_proof, node_id_of, verify_entry

__all__ = [
    "KEY_RE",
    "MAX_INSTANCES_PER_WRITER",
    "VALUE_CAPS",
    "ClusterTrust",
    "member_curve_keys",
]

#: A key: a known key space, then an id of at most 64 plain characters.
KEY_RE = re.compile(r"^(node|health|instance|member)/[A-Za-z0-9._-]{1,64}$")
#: Largest value per key space (bytes): a card with the facts of dozens of models, a
#: heartbeat with dozens of runners, a plan of a model with thousands of layers.
VALUE_CAPS = {NODE: 128 << 10, HEALTH: 64 << 10, INSTANCE: 512 << 10, MEMBER: 4 << 10}
#: Live instances one writer may hold (placing a model is rare; a flood is not).
MAX_INSTANCES_PER_WRITER = 256

#: Why an instance entry is refused, or None (see ``meshd.node.plans``).
PlanCheck = Callable[[Entry, LWWMap], "str | None"]


def _member(m: LWWMap, nid: str) -> Member | None:
    v = m.value(member_key(nid))
    return None if v is None else decode(v, Member)


def member_curve_keys(m: LWWMap) -> set[bytes]:
    """The CurveZMQ client keys (Z85) of every member: what the ZAP handlers admit."""
    out = set()
    for e in m.live(MEMBER):
        x = decode(e.value or b"", Member)
        if x is not None and len(x.key) == 32:
            out.add(curve_public_of(x.key))
    return out


class ClusterTrust:
    """The trust rules of one node's replica. With no cluster key (an open cluster) only
    the shape and the bounds are checked: there are no members and no signatures."""

    def __init__(self, cluster_key: bytes | None, plans: PlanCheck | None = None) -> None:
        self._cluster_key = cluster_key
        self._plans = plans

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
        if space == INSTANCE and e.value is not None and self._plans is not None:
            return self._plans(e, m)
        return None

    def _member_entry(self, e: Entry, m: LWWMap) -> str | None:
        nid = e.key[len(MEMBER) :]
        writer = _member(m, e.writer)
        if e.value is None:  # a member removed: only a member may say so
            if writer is None:
                return "not_member"
            return None if verify_entry(writer.key, e) else "bad_signature"
        x = decode(e.value, Member)
        if x is None or x.id != nid or len(x.key) != 32 or node_id_of(x.key) != nid:
            return "bad_member"
        if writer is not None:  # an approval (or a member re-stamping itself)
            return None if verify_entry(writer.key, e) else "bad_signature"
        if e.writer != nid or not x.proof:
            return "not_member"
        key = self._cluster_key
        if key is None or not hmac.compare_digest(x.proof, member_proof(key, x.key)):
            return "bad_member"
        return None if verify_entry(x.key, e) else "bad_signature"

    @staticmethod
    def _too_many(e: Entry, m: LWWMap) -> bool:
        """A new instance from a writer that holds its share of them already."""
        if not e.key.startswith(INSTANCE) or e.value is None or e.key in m:
            return False
        held = sum(1 for x in m.live(INSTANCE) if x.writer == e.writer)
        return held >= MAX_INSTANCES_PER_WRITER

"""The members a node's sockets deal with: each member's CURVE key, by node id.

One object serves both ends of every socket: the ZAP handler (a thread, or the loop)
admits a client key when :meth:`Members.admits` says so, a receive loop drops a message
whose sender's key it no longer admits, and a connecting socket names
:meth:`Members.key_of` the node it dials. Changed in place, never left empty by
mistake: the ZAP thread may read it at any moment.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["Members"]


class Members:
    """Member node id -> its CurveZMQ key (Z85), and the set of those keys."""

    def __init__(self, keys: Mapping[str, bytes] | None = None) -> None:
        self._by_node: dict[str, bytes] = {}
        self._admitted: set[bytes] = set()
        if keys:
            self.replace(keys)

    def admits(self, key: bytes) -> bool:
        """Whether ``key`` is a member's (what ZAP and every receive loop ask)."""
        return key in self._admitted

    def key_of(self, node: str) -> bytes | None:
        """The key a socket dialling ``node`` names (None: no member)."""
        return self._by_node.get(node)

    def as_dict(self) -> dict[str, bytes]:
        """A copy: node id -> key."""
        return dict(self._by_node)

    def replace(self, keys: Mapping[str, bytes]) -> set[str]:
        """The members are exactly ``keys`` from now on; the ids that are gone."""
        gone = set(self._by_node) - set(keys)
        # Shrink then grow, each atomic under the GIL: a key present before and after
        # is admitted throughout.
        self._admitted.intersection_update(keys.values())
        self._admitted.update(keys.values())
        for nid in gone:
            del self._by_node[nid]
        self._by_node.update(keys)
        return gone

    def __len__(self) -> int:
        return len(self._by_node)

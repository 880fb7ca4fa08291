"""The join plane's messages: what a node that is no member and a member's join desk
say on the desk's plain (not CURVE) port. Part of :mod:`.wire`'s names; see
:mod:`meshd.node.joining` for the protocol.
"""

from __future__ import annotations

import msgspec

from meshd.crdt.lww import Entry

#: Largest frame the join port takes: a join request is a few hundred bytes.
MAX_JOIN_FRAME = 64 * 1024


class JoinHello(msgspec.Struct, tag=True, kw_only=True):
    """A node that is not a member asks to join (sent again until it is answered).

    ``proof``: the node holds the cluster key (a secret file) and vouches for itself.
    ``invite`` + ``spake``: a pairing code (SPAKE2, message A). ``spake`` + ``tag``: it
    waits for approval by the code it shows (``tag`` names the code; see joining.py).
    """

    name: str
    key: bytes
    version: str = ""
    #: The wire protocol the joiner speaks (1: a meshd from before it was sent).
    protocol: int = 1
    proof: bytes = b""
    invite: str = ""
    spake: bytes = b""
    tag: bytes = b""


class JoinChallenge(msgspec.Struct, tag=True, kw_only=True):
    """Code exchange, step 1: the member's SPAKE2 message B and its key confirmation."""

    spake: bytes
    confirm: bytes


class JoinConfirm(msgspec.Struct, tag=True, kw_only=True):
    """Code exchange, step 2: the joiner's key confirmation (``invite`` "": approval)."""

    key: bytes
    invite: str
    confirm: bytes


class JoinPending(msgspec.Struct, tag=True, kw_only=True):
    """The request is held until a member approves it."""

    cluster: str
    name: str
    message: str


class JoinAccepted(msgspec.Struct, tag=True, kw_only=True):
    """The node is a member: the members, and the cluster key sealed to the joiner's key."""

    cluster: str
    name: str
    members: list[Entry]
    sealed_key: bytes = b""
    #: The cluster came from a secret file: its holders vouch for themselves.
    self_vouch: bool = False


class JoinRefused(msgspec.Struct, tag=True, kw_only=True):
    """No: ``code`` is ``wrong_code``, ``used_code``, ``name_taken``, ``busy``..."""

    code: str
    message: str


class JoinWho(msgspec.Struct, tag=True, kw_only=True):
    """Which node answers at this join port? (A seed names an address, not a node; the
    sockets of a secured cluster need the key of the node they dial.)"""


class JoinIdent(msgspec.Struct, tag=True, kw_only=True):
    """The answer to :class:`JoinWho`: the node's Ed25519 public key and the protocol it
    speaks. Claimed, not proven: the CURVE handshake with it proves it."""

    key: bytes
    protocol: int = 1


JoinMessage = (
    JoinHello | JoinChallenge | JoinConfirm | JoinPending | JoinAccepted | JoinRefused
    | JoinWho | JoinIdent
)  # fmt: skip

#: The gossip plane: greetings, deltas and digests on PUB/SUB, anti-entropy on the
#: mesh ROUTER.

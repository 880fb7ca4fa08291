"""Joining a cluster: what the member's join desk and the new node share.

A node that is not a member cannot open a single CURVE socket of the cluster (it knows
no server key, and no ZAP handler admits its client key). It talks to a member's
**join port** (the mesh port + 1; plain ZeroMQ, small frames) instead, one of three
ways, each authenticating both sides:

* **Approval** (no flags): the new node makes a fresh **approval code** (8 characters,
  ``ABCD-EFGH``) and shows it on its own screen only; it asks with its name, its
  public key and SPAKE2 message A for that code. A person types the code on a member
  (``meshctl approve CODE``); the member then runs SPAKE2 with it: each side proves it
  holds the same code before the member writes the entry and sends the cluster key
  (encrypted with the session key, and sealed to the joiner's own key inside). A desk
  that never saw the code (a fake one) cannot produce a confirmation the joiner takes,
  and a look-alike joiner cannot be approved by a code it never showed.
* **Pairing code** (``meshd up --join CODE``, from ``meshctl invite``): the same
  exchange, keyed by the invite's code, which the member made and the person carries.
  An eavesdropper learns nothing it could test codes against offline; a wrong guess
  costs the attacker the code itself after :data:`MAX_CODE_FAILURES`.
* **Secret file** (``--secret-file``): the node derives the cluster key itself and
  vouches for its own key with a proof that every holder of the key can check.

The member's side is :mod:`meshd.node.join_desk`, the new node's
:mod:`meshd.node.join_client`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

import nacl.public
import nacl.secret
import nacl.signing

from meshd.transport import wire
from meshd.transport.security import PROTOCOL

__all__ = [
    "APPROVAL_CODE_CHARS",
    "CODE_ALPHABET",
    "MAX_CODE_FAILURES",
    "Invite",
    "Pending",
    "Refusal",
    "Refusals",
    "approval_hits",
    "approval_tag",
    "clean_name",
    "door_refusal",
    "is_approval_code",
    "name_problem",
    "new_approval_code",
    "new_code",
    "printable",
]

#: Crockford's base32 without the letters people misread (I, L, O, U).
CODE_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
#: A code is 12 characters (``ABCD-EFGH-JKMN``): the first 4 name the invite, all 12 are
#: the password (60 bits; the attacker gets :data:`MAX_CODE_FAILURES` online guesses).
CODE_CHARS = 12
INVITE_ID_CHARS = 4
MAX_CODE_FAILURES = 3
#: An approval code: 8 characters (40 bits), typed once by the person approving.
APPROVAL_CODE_CHARS = 8
#: The public tag of an approval code (bound to the joiner's key) that lets the member
#: find which waiting node a typed code belongs to. One byte: a fake desk's offline
#: search over it leaves 32 bits to guess online, one guess per desk address (the joiner
#: asks a desk that failed no more); two waiting nodes may share a tag (both are then
#: challenged; only the one showing the code can confirm).
TAG_BYTES = 1
#: How long a code stays good.
INVITE_TTL_S = 600.0
#: Nodes waiting for approval at one member, in all and from one address. When full, a
#: newcomer is refused (``busy``): nothing the owner is being shown is pushed out.
MAX_PENDING = 32
MAX_PENDING_PER_ADDRESS = 4
#: A waiting node asks again every second; one silent this long has gone.
PENDING_TTL_S = 15.0
#: How long an approval waits for the joiner's next request, and how many exchanges it
#: allows (one suffices; a lost reply costs another).
APPROVAL_TTL_S = 120.0
MAX_APPROVAL_CHALLENGES = 4
MAX_INVITES = 16
#: Retired invite ids kept to say why a code no longer works (used, expired, burned).
MAX_RETIRED = 64
MAX_SESSIONS = 32
SESSION_TTL_S = 60.0
#: Join messages a second one address may send (twice that in a burst).
JOIN_RATE = 20.0
#: (address, reason) pairs :class:`Refusals` keeps (the least recent go first).
MAX_REFUSALS = 64
MAX_NAME_CHARS = 64

#: SPAKE2 identities, one pair per way in (a transcript of one never verifies as the other).
INVITE_IDS = {"idA": b"meshd-joiner", "idB": b"meshd-member"}
APPROVAL_IDS = {"idA": b"meshd-joiner-approval", "idB": b"meshd-member-approval"}

_ID_SHAPED = re.compile(r"[0-9a-fA-F]{16}")


def _random(n: int) -> str:
    raw = "".join(secrets.choice(CODE_ALPHABET) for _ in range(n))
    return "-".join(raw[i : i + 4] for i in range(0, n, 4))


def new_code() -> str:
    """A fresh pairing code, ``XXXX-XXXX-XXXX``."""
    return _random(CODE_CHARS)


def new_approval_code() -> str:
    """A fresh approval code, ``XXXX-XXXX``, shown on the joining machine only."""
    return _random(APPROVAL_CODE_CHARS)


def normal_code(code: str) -> str:
    """A code as typed, in canonical form (case, dashes, spaces and look-alikes)."""
    c = code.upper().replace("-", "").replace(" ", "")
    swaps: dict[str, str | int | None] = {"I": "1", "L": "1", "O": "0", "U": "V"}
    return c.translate(str.maketrans(swaps))


def code_chars(code: str) -> bool:
    """Whether ``code`` (as typed) holds nothing but code characters."""
    return all(ch in CODE_ALPHABET for ch in normal_code(code))


def is_approval_code(ref: str) -> bool:
    """Whether ``ref`` (as typed) has the shape of an approval code."""
    return len(normal_code(ref)) == APPROVAL_CODE_CHARS and code_chars(ref)


def approval_tag(code: str, key: bytes) -> bytes:
    """The public tag of ``code`` for the joiner holding ``key`` (see :data:`TAG_BYTES`)."""
    return hashlib.blake2b(
        normal_code(code).encode() + key, digest_size=TAG_BYTES, person=b"meshd-approve"
    ).digest()


def confirm_mac(session: bytes, who: bytes, transcript: bytes) -> bytes:
    """One side's key confirmation of a SPAKE2 exchange."""
    return hmac.new(session, who + transcript, hashlib.sha256).digest()


def session_box(session: bytes) -> nacl.secret.SecretBox:
    """The box a SPAKE2 session key opens."""
    return nacl.secret.SecretBox(
        hashlib.blake2b(session, digest_size=32, person=b"meshd-join").digest()
    )


def curve_private(seed: bytes) -> nacl.public.PrivateKey:
    """The X25519 half of an Ed25519 seed (what a sealed box to its key opens with)."""
    return nacl.public.PrivateKey(bytes(nacl.signing.SigningKey(seed).to_curve25519_private_key()))


def seal_to(key: bytes, data: bytes) -> bytes:
    """``data`` sealed to the Ed25519 public ``key`` (only its holder opens it)."""
    box = nacl.public.SealedBox(nacl.signing.VerifyKey(key).to_curve25519_public_key())
    return bytes(box.encrypt(data))


def printable(text: str, limit: int = 200) -> str:
    """``text`` with everything but printable characters removed, trimmed to ``limit``:
    what a stranger's words may put in a log line or on a terminal."""
    return "".join(ch for ch in text if ch.isprintable()).strip()[:limit]


def clean_name(name: str) -> str:
    """A name as it may be shown (see :func:`printable`)."""
    return printable(name, MAX_NAME_CHARS)


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a node's name (None: it can): printable characters only,
    at most 64, and nothing an owner could take for a node id."""
    if not name.strip():
        return "a node needs a name"
    if not name.isprintable():
        return f"the name {clean_name(name)!r} holds control characters; printable ones only"
    if len(name) > MAX_NAME_CHARS:
        return f"a name has at most {MAX_NAME_CHARS} characters"
    if _ID_SHAPED.fullmatch(name.strip()):
        return f"the name {name!r} looks like a node id (16 hex digits); pick another"
    return None


@dataclass
class Pending:
    """A node waiting for approval."""

    node_id: str
    name: str
    key: bytes
    first_seen: float
    last_seen: float
    #: Where it asks from (ZeroMQ's ``Peer-Address``), for ``meshctl doctor``.
    address: str = ""
    #: The public tag of the code its screen shows (:func:`approval_tag`).
    tag: bytes = b""
    #: The code a person typed for it, while that approval stands.
    password: bytes = b""
    approve_until: float = 0.0
    challenges: int = 0

    @property
    def approving(self) -> bool:
        """Whether a person approved it and the exchange is under way."""
        return bool(self.password) and self.approve_until >= time.monotonic()


@dataclass
class Refusal:
    """Someone turned away from one address for one reason, and how often."""

    address: str
    reason: str
    name: str
    node_id: str
    count: int
    last: float


class Refusals:
    """Who this node refused (join desk, ZAP), per address and reason, bounded: what
    ``meshctl doctor`` names when a node cannot get in."""

    def __init__(self, limit: int = MAX_REFUSALS) -> None:
        self._limit = limit
        self._by: OrderedDict[tuple[str, str], Refusal] = OrderedDict()

    def note(self, address: str, reason: str, name: str = "", node_id: str = "") -> None:
        """One more refusal of ``address`` for ``reason`` (who it said it was, if known)."""
        now = time.monotonic()
        name, node_id = clean_name(name), clean_name(node_id)
        r = self._by.pop((address, reason), None)
        if r is None:
            r = Refusal(address, reason, name, node_id, 0, now)
        r.count, r.last = r.count + 1, now
        r.name, r.node_id = name or r.name, node_id or r.node_id
        self._by[(address, reason)] = r
        while len(self._by) > self._limit:
            self._by.popitem(last=False)

    def recent(self) -> list[Refusal]:
        """Every refusal kept, the most recent last."""
        return list(self._by.values())


@dataclass
class Invite:
    """A pairing code this member issued."""

    id: str
    password: bytes
    expires: float
    failures: int = 0


def door_refusal(h: wire.JoinHello, self_vouch: bool) -> wire.JoinRefused | None:
    """Why a desk turns ``h`` away before anything else: a joiner of an older protocol
    (told both versions), or a proof over the cluster key where the key is no
    membership (only a secret-file cluster takes one: elsewhere a removed member's kept
    key must mint no one)."""
    if h.protocol < PROTOCOL:
        return wire.JoinRefused(
            code="old_protocol",
            message=f"this cluster speaks meshd protocol {PROTOCOL} and the asking node "
            f"protocol {h.protocol} (meshd {h.version or 'older'}): upgrade it",
        )
    if h.proof and not self_vouch:
        return wire.JoinRefused(code="not_member", message="not a member: ask one to approve it")
    return None


def approval_hits(pending: list[Pending], code: str, node: str = "") -> list[Pending]:
    """The waiting nodes an approval of ``code`` goes to (``node``: an id or a prefix,
    to choose among several): all whose tag matches it (only the one that shows it can
    finish the exchange). Raises LookupError, naming who waits, when ``code`` is not a
    code or no waiting node shows it: a name or an id alone proves nothing."""
    waiting = ", ".join(
        f"{p.name} (id {p.node_id}, from {p.address or '?'})" for p in pending
    ) or "nobody"  # fmt: skip
    if not is_approval_code(code):
        raise LookupError(
            f"approve with the code the new machine shows (`meshctl approve XXXX-XXXX`), "
            f"not {code!r}: a name or an id proves nothing; waiting here: {waiting}"
        )
    hits = [p for p in pending if p.node_id.startswith(node) and p.tag == approval_tag(code, p.key)]
    if not hits:
        raise LookupError(
            f"no node waiting here shows the code {code!r}: check it on the new "
            f"machine's screen; waiting here: {waiting}"
        )
    return hits

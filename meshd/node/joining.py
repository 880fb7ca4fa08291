"""Joining a cluster: the member's join desk, and the new node's way in.

A node that is not a member cannot open a single CURVE socket of the cluster (it knows
no server key, and no ZAP handler admits its client key). It talks to a member's
**join port** (the mesh port + 1; plain ZeroMQ, small frames) instead, one of three
ways:

* **Approval** (no flags): it sends its name and public key and is held as *pending*
  until a member approves it (``meshctl approve NAME``); then the member writes its
  member entry and hands it the cluster key sealed to its own key.
* **Pairing code** (``meshd up --join CODE``, from ``meshctl invite``): SPAKE2 turns
  the short code into a strong session key; each side proves it holds it before the
  member writes the entry and sends the cluster key encrypted with it. An eavesdropper
  learns nothing it could test codes against offline; a wrong guess costs the attacker
  the code itself after :data:`MAX_CODE_FAILURES`.
* **Secret file** (``--secret-file``): the node derives the cluster key itself and
  vouches for its own key with a proof that every holder of the key can check.

The first node of a cluster (no flags, nobody found within ``settle_s``) makes the
cluster key. What a member gives a joiner is in :class:`~meshd.transport.wire.JoinAccepted`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import nacl.exceptions
import nacl.public
import nacl.secret
import nacl.signing
import spake2
import zmq
import zmq.asyncio

import meshd
from meshd.crdt.views import Member, decode, member_key
from meshd.transport import wire
from meshd.transport.identity import NodeKey, member_proof, node_id_of
from meshd.transport.ratelimit import PeerRateLimiter
from meshd.transport.security import PROTOCOL, cluster_id_of
from meshd.transport.sockets import CONTROL, bind, open_socket

from .cluster_store import StoredCluster
from .state import ClusterState
from .trust import member_entries

__all__ = [
    "CODE_ALPHABET",
    "MAX_CODE_FAILURES",
    "Invite",
    "JoinDesk",
    "JoinOutcome",
    "Pending",
    "Refusal",
    "Refusals",
    "ask_to_join",
    "new_code",
    "whois",
]

log = logging.getLogger("meshd.join")

#: Crockford's base32 without the letters people misread (I, L, O, U).
CODE_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
#: A code is 12 characters (``ABCD-EFGH-JKMN``): the first 4 name the invite, all 12 are
#: the password (60 bits; the attacker gets :data:`MAX_CODE_FAILURES` online guesses).
CODE_CHARS = 12
INVITE_ID_CHARS = 4
MAX_CODE_FAILURES = 3
#: How long a code stays good.
INVITE_TTL_S = 600.0
#: Requests held for approval (oldest dropped first) and how long one waits unseen.
MAX_PENDING = 32
PENDING_TTL_S = 600.0
MAX_INVITES = 16
MAX_SESSIONS = 32
SESSION_TTL_S = 60.0
#: Join messages a second one address may send (twice that in a burst).
JOIN_RATE = 20.0
#: (address, reason) pairs :class:`Refusals` keeps (the least recent go first).
MAX_REFUSALS = 64

_SPAKE_IDS = {"idA": b"meshd-joiner", "idB": b"meshd-member"}


def new_code() -> str:
    """A fresh pairing code, ``XXXX-XXXX-XXXX``."""
    raw = "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_CHARS))
    return "-".join(raw[i : i + 4] for i in range(0, CODE_CHARS, 4))


def _normal(code: str) -> str:
    c = code.upper().replace("-", "").replace(" ", "")
    swaps: dict[str, str | int | None] = {"I": "1", "L": "1", "O": "0", "U": "V"}
    return c.translate(str.maketrans(swaps))


def _confirm(session: bytes, who: bytes, transcript: bytes) -> bytes:
    return hmac.new(session, who + transcript, hashlib.sha256).digest()


def _session_box(session: bytes) -> nacl.secret.SecretBox:
    return nacl.secret.SecretBox(
        hashlib.blake2b(session, digest_size=32, person=b"meshd-join").digest()
    )


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
        r = self._by.pop((address, reason), None)
        if r is None:
            r = Refusal(address, reason, name[:64], node_id[:64], 0, now)
        r.count, r.last = r.count + 1, now
        r.name, r.node_id = name[:64] or r.name, node_id[:64] or r.node_id
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


@dataclass
class _Session:
    invite: str
    name: str
    session: bytes
    transcript: bytes
    expires: float


@dataclass
class JoinDesk:
    """A member's join port: requests from nodes that want in.

    ``write_member`` writes a member entry (signed by this node) into the shared map.
    """

    state: ClusterState
    cluster: StoredCluster
    name: str
    write_member: Callable[[Member], None]
    #: Counts what the desk drops or refuses (socket ``join``; see /healthz).
    count: Callable[[str], None] = lambda reason: None
    #: Whom it refused, by address (``meshctl doctor``).
    refusals: Refusals = field(default_factory=Refusals)
    pending: OrderedDict[str, Pending] = field(default_factory=OrderedDict)
    invites: dict[str, Invite] = field(default_factory=dict)
    _sessions: OrderedDict[str, _Session] = field(default_factory=OrderedDict)
    _limiter: PeerRateLimiter = field(
        default_factory=lambda: PeerRateLimiter(JOIN_RATE, 2 * JOIN_RATE)
    )
    _sock: zmq.asyncio.Socket | None = None
    port: int = 0
    #: This node's Ed25519 public key (what :class:`~meshd.transport.wire.JoinWho` asks).
    own_key: bytes = b""

    # -- the socket ------------------------------------------------------------------
    def bind(self, ctx: zmq.asyncio.Context, host: str, port: int) -> int:
        """Bind the join port (plain ZeroMQ: the joiner has no key to speak CURVE)."""
        sock = open_socket(ctx, zmq.ROUTER, CONTROL, None, server=True)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_JOIN_FRAME)
        try:
            self.port = bind(sock, host, port)
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or port == 0:
                sock.close(linger=0)
                raise
            # Mesh port + 1 is only a convention (a restarted node keeps its mesh port,
            # and meanwhile any outgoing connection may own the next one): refusing to
            # start would be worse than a desk that discovery still advertises.
            self.port = bind(sock, host, 0)
            log.warning(
                "join port %d is taken; the join desk listens on %d instead (zeroconf "
                "advertises it; a seed given as HOST:MESH_PORT will not find it)",
                port,
                self.port,
            )
        self._sock = sock
        return self.port

    async def run(self) -> None:
        """Answer join messages until cancelled."""
        assert self._sock is not None
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                reply = self._answer(frames)
                if reply is not None:
                    await self._sock.send_multipart([frames[0].bytes, wire.encode(reply)])
        finally:
            self._sock.close(linger=0)

    def _drop(self, reason: str) -> None:
        self.count(reason)

    def _answer(self, frames: list[zmq.Frame]) -> wire.JoinMessage | None:
        if len(frames) != 2:
            self._drop("shape")
            return None
        try:
            who = frames[1].get("Peer-Address")
        except zmq.ZMQError:
            who = frames[0].bytes.hex()
        if not self._limiter.allow(str(who)):
            self._drop("rate_limited")
            self.refusals.note(str(who), "busy")
            return wire.JoinRefused(code="busy", message="too many join requests; slow down")
        try:
            msg = wire.decode_join(frames[1].buffer)
        except wire.FrameError as e:
            self._drop(e.reason)
            return None
        try:
            if isinstance(msg, wire.JoinWho):
                return wire.JoinIdent(key=self.own_key, protocol=PROTOCOL)
            if isinstance(msg, wire.JoinHello):
                reply = self.hello(msg, time.monotonic())
            elif isinstance(msg, wire.JoinConfirm):
                reply = self.confirm(msg, time.monotonic())
            else:
                self._drop("unexpected")
                return None
        except (ValueError, TypeError, nacl.exceptions.CryptoError, spake2.SPAKEError) as e:
            self._drop("bad_request")
            self.refusals.note(str(who), "bad_request")
            return wire.JoinRefused(code="bad_request", message=str(e)[:200])
        self._note(str(who), msg, reply)
        return reply

    def _note(self, who: str, msg: wire.JoinMessage, reply: wire.JoinMessage) -> None:
        """Remember where a refused or waiting node asks from (``meshctl doctor``)."""
        key = getattr(msg, "key", b"")
        nid = node_id_of(key) if len(key) == 32 else ""
        if isinstance(reply, wire.JoinPending) and nid in self.pending:
            self.pending[nid].address = who
        elif isinstance(reply, wire.JoinRefused):
            name = msg.name.strip() if isinstance(msg, wire.JoinHello) else ""
            self.refusals.note(who, reply.code, name, nid)

    # -- the rules -------------------------------------------------------------------
    def hello(self, h: wire.JoinHello, now: float) -> wire.JoinMessage:
        """Answer a join request (pure but for the member entry it may write)."""
        if len(h.key) != 32:
            return wire.JoinRefused(code="bad_request", message="a key is 32 bytes")
        if h.protocol < PROTOCOL:
            return wire.JoinRefused(
                code="old_protocol",
                message=f"this cluster speaks meshd protocol {PROTOCOL} and the asking node "
                f"protocol {h.protocol} (meshd {h.version or 'older'}): upgrade it",
            )
        nid = node_id_of(h.key)
        self._expire(now)
        if self._member_key(nid) == h.key:
            self.pending.pop(nid, None)
            return self._accepted(h.key)
        name = h.name.strip()[:64] or nid
        if h.proof:
            if not self.cluster.self_vouch:
                # Only a secret-file cluster's key is a membership: elsewhere a kept key
                # of a removed member must not mint one.
                self.count("bad_proof")
                return wire.JoinRefused(
                    code="not_member", message="not a member: ask a member to approve it"
                )
            if not hmac.compare_digest(h.proof, member_proof(self.cluster.key, h.key)):
                self.count("bad_proof")
                return wire.JoinRefused(code="bad_proof", message="not this cluster's secret")
            self._admit(nid, name, h.key)
            return self._accepted(h.key)
        if h.invite:
            return self._challenge(nid, h, now)
        p = self.pending.pop(nid, None)
        if p is None:
            log.warning(
                "node %r (%s) asks to join; approve it with `meshctl approve %s`",
                name, nid, name,
            )  # fmt: skip
            p = Pending(nid, name, h.key, now, now)
        p.last_seen, p.name = now, name
        self.pending[nid] = p
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        return wire.JoinPending(
            cluster=self.cluster.id,
            name=self.cluster.name,
            message=f"waiting for a member to approve: meshctl approve {name}",
        )

    def _challenge(self, nid: str, h: wire.JoinHello, now: float) -> wire.JoinMessage:
        inv = self.invites.get(h.invite.upper())
        if inv is None:
            return wire.JoinRefused(code="unknown_invite", message="no such code here")
        # Every exchange is one guess of the code (a joiner with a wrong code learns so
        # from our confirmation and need not come back): the code is burned after
        # MAX_CODE_FAILURES exchanges that did not end in a join.
        inv.failures += 1
        if inv.failures > MAX_CODE_FAILURES:
            del self.invites[inv.id]
            log.warning("pairing code %s-... burned after %d tries", inv.id, MAX_CODE_FAILURES)
            return wire.JoinRefused(code="unknown_invite", message="no such code here")
        b = spake2.SPAKE2_B(inv.password, **_SPAKE_IDS)
        msg_b = b.start()
        session = b.finish(h.spake)
        transcript = h.key + h.spake + msg_b
        self._sessions.pop(nid, None)
        name = h.name.strip()[:64] or nid
        self._sessions[nid] = _Session(inv.id, name, session, transcript, now + SESSION_TTL_S)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return wire.JoinChallenge(spake=msg_b, confirm=_confirm(session, b"member", transcript))

    def confirm(self, c: wire.JoinConfirm, now: float) -> wire.JoinMessage:
        """Second step of a pairing: the joiner proves it derived the same key."""
        if len(c.key) != 32:
            return wire.JoinRefused(code="bad_request", message="a key is 32 bytes")
        nid = node_id_of(c.key)
        s = self._sessions.pop(nid, None)
        inv = self.invites.get(c.invite.upper())
        if s is None or s.expires < now or inv is None or s.invite != inv.id:
            return wire.JoinRefused(code="unknown_invite", message="no pairing under way")
        if not hmac.compare_digest(c.confirm, _confirm(s.session, b"joiner", s.transcript)):
            self.count("wrong_code")
            return wire.JoinRefused(code="wrong_code", message="wrong pairing code")
        del self.invites[inv.id]  # one use
        self._admit(nid, s.name, c.key)
        acc = self._accepted(c.key)
        acc.sealed_key = bytes(_session_box(s.session).encrypt(self.cluster.key))
        return acc

    def _accepted(self, key: bytes) -> wire.JoinAccepted:
        box = nacl.public.SealedBox(nacl.signing.VerifyKey(key).to_curve25519_public_key())
        return wire.JoinAccepted(
            cluster=self.cluster.id,
            name=self.cluster.name,
            # Removals too: the new node refuses a removed member from its first moment.
            members=member_entries(self.state.map),
            sealed_key=bytes(box.encrypt(self.cluster.key)),
            self_vouch=self.cluster.self_vouch,
        )

    def _admit(self, nid: str, name: str, key: bytes) -> None:
        self.pending.pop(nid, None)
        self.write_member(
            Member(id=nid, name=name, key=key, by=self.state.node_id, at_ms=int(time.time() * 1000))
        )
        log.info("node %r (%s) is a member now", name, nid)

    def _member_key(self, nid: str) -> bytes | None:
        v = self.state.map.value(member_key(nid))
        x = None if v is None else decode(v, Member)
        return None if x is None else x.key

    def _expire(self, now: float) -> None:
        for nid in [n for n, p in self.pending.items() if now - p.last_seen > PENDING_TTL_S]:
            del self.pending[nid]
        for iid in [i for i, v in self.invites.items() if v.expires < now]:
            del self.invites[iid]

    # -- what members do -------------------------------------------------------------
    def approve(self, ref: str) -> Pending:
        """Let a pending node in (``ref``: its name, or its id or a prefix of it).

        Raises LookupError when none or several match.
        """
        self._expire(time.monotonic())
        hits = [p for p in self.pending.values() if ref in (p.name, p.node_id)]
        if not hits:
            hits = [p for p in self.pending.values() if len(ref) >= 4 and p.node_id.startswith(ref)]
        if len(hits) != 1:
            names = ", ".join(f"{p.name} ({p.node_id})" for p in self.pending.values()) or "none"
            what = "no pending node" if not hits else "several pending nodes"
            raise LookupError(f"{what} matches {ref!r}; pending: {names}")
        p = hits[0]
        self._admit(p.node_id, p.name, p.key)
        return p

    def invite(self) -> tuple[str, float]:
        """A new pairing code and the seconds it stays good."""
        now = time.monotonic()
        self._expire(now)
        code = new_code()
        raw = _normal(code)
        self.invites[raw[:INVITE_ID_CHARS]] = Invite(
            raw[:INVITE_ID_CHARS], raw.encode(), now + INVITE_TTL_S
        )
        while len(self.invites) > MAX_INVITES:
            del self.invites[next(iter(self.invites))]
        return code, INVITE_TTL_S


# -- the new node's side -----------------------------------------------------------------


@dataclass
class JoinOutcome:
    """What a node that got in knows of its cluster."""

    cluster: StoredCluster
    via: str


class JoinRefusedError(RuntimeError):
    """A member said no for good (a wrong code, a foreign secret)."""


async def _ask(
    ctx: zmq.asyncio.Context, host: str, port: int, msg: wire.JoinMessage, timeout: float
) -> wire.JoinMessage | None:
    sock = open_socket(ctx, zmq.DEALER, CONTROL, None, server=False)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.ZMQ_MAX_MSG_SIZE)
    try:
        h = f"[{host}]" if ":" in host else host
        sock.connect(f"tcp://{h}:{port}")
        await sock.send(wire.encode(msg))
        async with asyncio.timeout(timeout):
            frame = await sock.recv()
    except (TimeoutError, zmq.ZMQError):
        return None
    finally:
        sock.close(linger=0)
    try:
        return msgspec.msgpack.decode(frame, type=wire.JoinMessage)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


async def ask_to_join(
    ctx: zmq.asyncio.Context,
    key: NodeKey,
    name: str,
    candidates: Callable[[], list[tuple[str, int]]],
    *,
    code: str | None = None,
    proof: bytes = b"",
    on_pending: Callable[[str], None] | None = None,
    attempt_timeout: float = 2.0,
    retry_s: float = 1.0,
) -> JoinOutcome:
    """Ask the join ports ``candidates()`` returns (``(host, port)``, asked again every
    round) until one lets this node in; the cluster key and members it handed over.

    Raises :class:`JoinRefusedError` for a definite no (a wrong code).
    """
    told = False
    while True:
        for host, port in candidates():
            got = await _join_once(ctx, key, name, host, port, code, proof, attempt_timeout)
            if isinstance(got, JoinOutcome):
                return got
            if isinstance(got, wire.JoinPending) and not told:
                told = True
                if on_pending is not None:
                    on_pending(f"{got.message} (on a node of cluster {got.name!r})")
            if isinstance(got, wire.JoinRefused) and got.code in (
                "wrong_code", "bad_proof", "old_protocol"
            ):  # fmt: skip
                raise JoinRefusedError(got.message)
        await asyncio.sleep(retry_s)


async def _join_once(
    ctx: zmq.asyncio.Context,
    key: NodeKey,
    name: str,
    host: str,
    port: int,
    code: str | None,
    proof: bytes,
    timeout: float,
) -> JoinOutcome | wire.JoinMessage | None:
    hello = wire.JoinHello(
        name=name, key=key.public, version=meshd.__version__, protocol=PROTOCOL, proof=proof
    )
    session: bytes | None = None
    if code is not None:
        raw = _normal(code)
        a = spake2.SPAKE2_A(raw.encode(), **_SPAKE_IDS)
        hello.invite, hello.spake = raw[:INVITE_ID_CHARS], a.start()
    reply = await _ask(ctx, host, port, hello, timeout)
    if code is not None and isinstance(reply, wire.JoinChallenge):
        try:
            session = a.finish(reply.spake)
        except spake2.SPAKEError:
            return None
        transcript = key.public + hello.spake + reply.spake
        if not hmac.compare_digest(reply.confirm, _confirm(session, b"member", transcript)):
            # The member derived another key: the code is wrong (or this is no member).
            return wire.JoinRefused(code="wrong_code", message="wrong pairing code")
        confirm = wire.JoinConfirm(
            key=key.public, invite=hello.invite, confirm=_confirm(session, b"joiner", transcript)
        )
        reply = await _ask(ctx, host, port, confirm, timeout)
    if not isinstance(reply, wire.JoinAccepted):
        return reply
    with contextlib.suppress(nacl.exceptions.CryptoError, ValueError):
        if session is not None:
            cluster_key = _session_box(session).decrypt(reply.sealed_key)
        else:
            private = nacl.public.PrivateKey(
                bytes(nacl.signing.SigningKey(key.seed).to_curve25519_private_key())
            )
            cluster_key = nacl.public.SealedBox(private).decrypt(reply.sealed_key)
        if cluster_id_of(cluster_key) != reply.cluster:
            return None
        return JoinOutcome(
            StoredCluster(
                key=cluster_key, name=reply.name, members=list(reply.members),
                self_vouch=reply.self_vouch,
            ),
            via=f"{host}:{port}",
        )  # fmt: skip
    return None


async def whois(
    ctx: zmq.asyncio.Context, host: str, port: int, timeout: float = 2.0
) -> bytes | None:
    """The Ed25519 key the node at join port ``host:port`` claims (None: no answer, or
    a node older than :class:`~meshd.transport.wire.JoinWho`)."""
    reply = await _ask(ctx, host, port, wire.JoinWho(), timeout)
    if isinstance(reply, wire.JoinIdent) and len(reply.key) == 32:
        return reply.key
    return None

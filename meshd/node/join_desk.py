"""A member's join desk: requests from nodes that want in (see :mod:`meshd.node.joining`).

Nothing here lets a node in on its word: a code is proven by SPAKE2 before a member entry
is written, a secret-file node by a proof over the cluster key. The waiting list is
bounded in all and per address, forgets joiners that stopped asking, pushes nobody out.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import nacl.exceptions
import zmq
import zmq.asyncio

from meshd.crdt.views import Member, decode, member_key, members
from meshd.transport import wire
from meshd.transport.identity import member_proof, node_id_of
from meshd.transport.ratelimit import PeerRateLimiter
from meshd.transport.security import PROTOCOL
from meshd.transport.sockets import CONTROL, bind, open_socket

from .cluster_store import StoredCluster
from .joining import (
    APPROVAL_IDS,
    APPROVAL_TTL_S,
    INVITE_ID_CHARS,
    INVITE_IDS,
    INVITE_TTL_S,
    JOIN_RATE,
    MAX_APPROVAL_CHALLENGES,
    MAX_CODE_FAILURES,
    MAX_INVITES,
    MAX_PENDING,
    MAX_PENDING_PER_ADDRESS,
    MAX_RETIRED,
    MAX_SESSIONS,
    PENDING_TTL_S,
    SESSION_TTL_S,
    TAG_BYTES,
    Invite,
    Pending,
    Refusals,
    approval_hits,
    clean_name,
    confirm_mac,
    door_refusal,
    name_problem,
    new_code,
    normal_code,
    seal_to,
    session_box,
)
from .state import ClusterState
from .trust import member_entries

__all__ = ["JoinDesk"]

log = logging.getLogger("meshd.join")


@dataclass
class _Session:
    #: The invite's id, or "" for an approval.
    invite: str
    name: str
    password: bytes
    session: bytes
    transcript: bytes
    expires: float


def _refused(code: str, message: str) -> wire.JoinRefused:
    return wire.JoinRefused(code=code, message=message)


@dataclass
class JoinDesk:
    """A member's join port.

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
    _retired: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _sessions: OrderedDict[str, _Session] = field(default_factory=OrderedDict)
    #: Nodes let in lately, with their code: a joiner whose reply was lost asks again.
    _recent: OrderedDict[str, _Session] = field(default_factory=OrderedDict)
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

    def _answer(self, frames: list[zmq.Frame]) -> wire.JoinMessage | None:
        if len(frames) != 2:
            self.count("shape")
            return None
        try:
            who = str(frames[1].get("Peer-Address"))
        except zmq.ZMQError:
            who = frames[0].bytes.hex()
        if not self._limiter.allow(who):
            self.count("rate_limited")
            self.refusals.note(who, "busy")
            return _refused("busy", "too many join requests; slow down")
        try:
            msg = wire.decode_join(frames[1].buffer)
        except wire.FrameError as e:
            self.count(e.reason)
            return None
        import spake2  # at the first join asked, not at every node's start (~0.06 s)

        try:
            if isinstance(msg, wire.JoinWho):
                return wire.JoinIdent(key=self.own_key, protocol=PROTOCOL)
            if isinstance(msg, wire.JoinHello):
                reply = self.hello(msg, time.monotonic(), who)
            elif isinstance(msg, wire.JoinConfirm):
                reply = self.confirm(msg, time.monotonic())
            else:
                self.count("unexpected")
                return None
        except (ValueError, TypeError, nacl.exceptions.CryptoError, spake2.SPAKEError) as e:
            self.count("bad_request")
            self.refusals.note(who, "bad_request")
            return _refused("bad_request", str(e)[:200])
        if isinstance(reply, wire.JoinRefused):
            key = getattr(msg, "key", b"")
            name = msg.name if isinstance(msg, wire.JoinHello) else ""
            self.refusals.note(who, reply.code, name, node_id_of(key) if len(key) == 32 else "")
        return reply

    # -- the rules -------------------------------------------------------------------
    def hello(self, h: wire.JoinHello, now: float, address: str = "") -> wire.JoinMessage:
        """Answer a join request (pure but for the member entry it may write)."""
        if len(h.key) != 32:
            return _refused("bad_request", "a key is 32 bytes")
        no = door_refusal(h, self.cluster.self_vouch)
        if no is not None:
            return no
        nid = node_id_of(h.key)
        self._expire(now)
        member = self._member_key(nid) == h.key
        if h.proof:
            if not hmac.compare_digest(h.proof, member_proof(self.cluster.key, h.key)):
                self.count("bad_proof")
                return _refused("bad_proof", "not this cluster's secret")
            if not member:  # vouched for by its proof: an owner, as it says of itself
                self._admit(nid, clean_name(h.name) or nid, h.key, proof=h.proof)
            return self._accepted(h.key)
        if not h.spake:
            # An older joiner: it asks without a code, and nothing would prove this desk
            # to it. A member that asks (a restarted one re-reading its members) is told.
            if member:
                return self._accepted(h.key)
            return _refused("old_version", "this cluster's meshd asks a new node for an "
                            "approval code: update meshd on the new node")  # fmt: skip
        if member:
            again = self._recent.get(nid)
            if again is None:
                return _refused("already_member", "this key is a member already")
            return self._challenge(nid, h, again.invite, again.name, again.password, now)
        problem = self._name_problem(h.name, nid)
        if problem is not None:
            return problem
        if h.invite:
            return self._invite_challenge(nid, h, now)
        return self._wait(nid, h, now, address)

    def _name_problem(self, name: str, nid: str) -> wire.JoinRefused | None:
        why = name_problem(name)
        if why is not None:
            return _refused("bad_name", why)
        taken = [m for m in members(self.state.map).values() if m.name == name.strip()]
        if any(m.id != nid for m in taken):
            return _refused(
                "name_taken",
                f"a member is named {name.strip()!r} already: start this node with "
                "--name OTHER (or remove that member first)",
            )
        return None

    def _wait(self, nid: str, h: wire.JoinHello, now: float, address: str) -> wire.JoinMessage:
        if len(h.tag) != TAG_BYTES:
            return _refused("bad_request", f"an approval tag is {TAG_BYTES} bytes")
        name = h.name.strip()
        p = self.pending.get(nid)
        if p is None:
            here = sum(1 for x in self.pending.values() if x.address == address)
            if len(self.pending) >= MAX_PENDING or here >= MAX_PENDING_PER_ADDRESS:
                # Refuse the newcomer rather than push out one the owner may be reading.
                self.count("pending_full")
                return _refused("busy", "too many nodes wait here already; try later")
            p = Pending(nid, name, h.key, now, now, address=address, tag=h.tag)
            self.pending[nid] = p
            log.warning(
                "node %r (%s) asks to join from %s; let it in with `meshctl approve "
                "CODE`, CODE being what its screen shows", name, nid, address or "?",
            )  # fmt: skip
        p.last_seen, p.name, p.address = now, name, address or p.address
        if p.tag != h.tag:  # it shows another code now: an approval of the old one is void
            p.tag, p.password = h.tag, b""
        if p.password and p.approve_until >= now:
            p.challenges += 1
            if p.challenges <= MAX_APPROVAL_CHALLENGES:
                return self._challenge(nid, h, "", name, p.password, now)
            log.warning("approval of %r (%s) withdrawn: %d exchanges without a confirmation",
                        name, nid, MAX_APPROVAL_CHALLENGES)  # fmt: skip
            p.password = b""
        return wire.JoinPending(
            cluster=self.cluster.id,
            name=self.cluster.name,
            message="waiting for a member to approve the code this node shows",
        )

    def _invite_challenge(self, nid: str, h: wire.JoinHello, now: float) -> wire.JoinMessage:
        iid = h.invite.upper()
        inv = self.invites.get(iid)
        if inv is None:
            why = self._retired.get(iid)
            if why is None:
                return _refused("unknown_invite", "no such code here")
            return _refused(f"{why}_code", f"this pairing code was {why}")
        # Every exchange is one guess of the code (a joiner with a wrong code learns so
        # from our confirmation and need not come back): the code is burned after
        # MAX_CODE_FAILURES exchanges that did not end in a join.
        inv.failures += 1
        if inv.failures > MAX_CODE_FAILURES:
            self._retire(inv.id, "burned")
            log.warning("pairing code %s-... burned after %d tries", inv.id, MAX_CODE_FAILURES)
            return _refused("burned_code", "this pairing code was burned by wrong tries")
        return self._challenge(nid, h, inv.id, h.name.strip(), inv.password, now)

    def _challenge(
        self, nid: str, h: wire.JoinHello, invite: str, name: str, password: bytes, now: float
    ) -> wire.JoinMessage:
        import spake2

        b = spake2.SPAKE2_B(password, **(INVITE_IDS if invite else APPROVAL_IDS))
        msg_b = b.start()
        session = b.finish(h.spake)
        transcript = h.key + h.spake + msg_b
        self._sessions.pop(nid, None)
        self._sessions[nid] = _Session(
            invite, name, password, session, transcript, now + SESSION_TTL_S
        )
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return wire.JoinChallenge(spake=msg_b, confirm=confirm_mac(session, b"member", transcript))

    def confirm(self, c: wire.JoinConfirm, now: float) -> wire.JoinMessage:
        """Second step of a code exchange: the joiner proves it derived the same key."""
        if len(c.key) != 32:
            return _refused("bad_request", "a key is 32 bytes")
        nid = node_id_of(c.key)
        s = self._sessions.pop(nid, None)
        if s is None or s.expires < now or s.invite != c.invite.upper():
            return _refused("unknown_invite", "no exchange under way")
        if not hmac.compare_digest(c.confirm, confirm_mac(s.session, b"joiner", s.transcript)):
            self.count("wrong_code")
            return _refused("wrong_code", "wrong code")
        if s.invite and s.invite in self.invites:
            del self.invites[s.invite]  # one use
            self._retire(s.invite, "used")
        if self._member_key(nid) != c.key:
            self._admit(nid, s.name, c.key)
        self._recent.pop(nid, None)
        self._recent[nid] = s
        while len(self._recent) > MAX_SESSIONS:
            self._recent.popitem(last=False)
        acc = self._accepted(c.key)
        # The session key proves this desk to the joiner; sealed inside to its own key,
        # the cluster key opens only for the holder of the key that was approved.
        acc.sealed_key = bytes(session_box(s.session).encrypt(acc.sealed_key))
        return acc

    def _accepted(self, key: bytes) -> wire.JoinAccepted:
        return wire.JoinAccepted(
            cluster=self.cluster.id,
            name=self.cluster.name,
            # Removals too: the new node refuses a removed member from its first moment.
            members=member_entries(self.state.map),
            sealed_key=seal_to(key, self.cluster.key),
            self_vouch=self.cluster.self_vouch,
        )

    def _admit(self, nid: str, name: str, key: bytes, proof: bytes = b"") -> None:
        self.pending.pop(nid, None)
        by = nid if proof else self.state.node_id
        self.write_member(
            Member(id=nid, name=name, key=key, by=by, at_ms=int(time.time() * 1000), proof=proof)
        )
        log.info("node %r (%s) is a member now", name, nid)

    def _member_key(self, nid: str) -> bytes | None:
        v = self.state.map.value(member_key(nid))
        x = None if v is None else decode(v, Member)
        return None if x is None else x.key

    def _retire(self, iid: str, why: str) -> None:
        self.invites.pop(iid, None)
        self._retired.pop(iid, None)
        self._retired[iid] = why
        while len(self._retired) > MAX_RETIRED:
            self._retired.popitem(last=False)

    def _expire(self, now: float) -> None:
        for nid in [n for n, p in self.pending.items() if now - p.last_seen > PENDING_TTL_S]:
            del self.pending[nid]
        for iid in [i for i, v in self.invites.items() if v.expires < now]:
            self._retire(iid, "expired")
        for nid in [n for n, s in self._recent.items() if s.expires < now]:
            del self._recent[nid]

    # -- what members do -------------------------------------------------------------
    def approve(self, code: str, node: str = "") -> list[Pending]:
        """Approve the waiting node whose screen shows ``code`` (``node``: an id or a
        prefix of it, to choose among several); the nodes the code was let go to (all
        whose tag matches it: only the one that shows it can finish the exchange).

        Raises LookupError, naming who waits, when ``code`` is not a code or no waiting
        node shows it. A name or an id alone is refused: anyone may claim them, and the
        code is also what proves this member to the new node.
        """
        now = time.monotonic()
        self._expire(now)
        hits = approval_hits(list(self.pending.values()), code, node)
        for p in hits:
            p.password, p.approve_until, p.challenges = normal_code(code).encode(), now, 0
            p.approve_until += APPROVAL_TTL_S
            log.info("approved %r (%s): it gets the cluster key once it confirms the code",
                     p.name, p.node_id)  # fmt: skip
        return hits

    def invite(self) -> tuple[str, float]:
        """A new pairing code and the seconds it stays good."""
        now = time.monotonic()
        self._expire(now)
        code = new_code()
        raw = normal_code(code)
        iid = raw[:INVITE_ID_CHARS]
        self.invites[iid] = Invite(iid, raw.encode(), now + INVITE_TTL_S)
        self._retired.pop(iid, None)
        while len(self.invites) > MAX_INVITES:
            del self.invites[next(iter(self.invites))]
        return code, INVITE_TTL_S

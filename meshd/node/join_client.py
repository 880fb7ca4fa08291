"""The new node's way in: it asks members' join desks (see :mod:`meshd.node.joining`).

It takes the cluster key only from a desk that proved the code (the pairing code it
was given, or the approval code it shows): an unsolicited or unproven "yes" is
ignored. A desk's "no" ends the search only once every desk found says no, and a desk
that answered with a wrong proof is not asked again (each try costs a guess).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import nacl.exceptions
import nacl.public
import zmq
import zmq.asyncio

import meshd
from meshd.transport import wire
from meshd.transport.identity import NodeKey
from meshd.transport.security import PROTOCOL, cluster_id_of
from meshd.transport.sockets import CONTROL, open_socket

from .cluster_store import StoredCluster

if TYPE_CHECKING:
    import spake2
from .joining import (
    APPROVAL_IDS,
    INVITE_ID_CHARS,
    INVITE_IDS,
    approval_tag,
    confirm_mac,
    curve_private,
    new_approval_code,
    normal_code,
    printable,
    session_box,
)

__all__ = [
    "DeskSeen",
    "JoinOutcome",
    "JoinRefusedError",
    "NoClusterFoundError",
    "ask_to_join",
    "whois",
]

log = logging.getLogger("meshd.join")

#: Refusals that are a desk's last word (others, ``busy``, are asked again).
FINAL = frozenset({
    "wrong_code", "used_code", "expired_code", "burned_code", "unknown_invite", "bad_name",
    "name_taken", "bad_proof", "old_version", "already_member", "bad_request",
    "old_protocol", "not_member",
})  # fmt: skip
#: Which refusal says most when every desk refuses (the first one found wins).
_TELLING = ("wrong_code", "used_code", "expired_code", "burned_code", "name_taken",
            "bad_name", "bad_proof", "not_member", "already_member", "old_version",
            "old_protocol")  # fmt: skip


@dataclass
class JoinOutcome:
    """What a node that got in knows of its cluster."""

    cluster: StoredCluster
    via: str


@dataclass(frozen=True)
class DeskSeen:
    """A desk that holds this node for approval."""

    address: str
    cluster: str
    name: str


class JoinRefusedError(RuntimeError):
    """Every desk found said no for good (a wrong or used code, a name taken...);
    ``code`` is the telling refusal's."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class NoClusterFoundError(RuntimeError):
    """No desk answered within the search bound; ``asked``: the addresses tried."""

    def __init__(self, searched_s: float, asked: list[str]) -> None:
        super().__init__(f"no member answered within {searched_s:.0f} s")
        self.searched_s, self.asked = searched_s, asked


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


@dataclass
class _Joiner:
    ctx: zmq.asyncio.Context
    key: NodeKey
    name: str
    #: The pairing code (``--join``), or None: approval (or a proof).
    code: str | None
    proof: bytes
    timeout: float
    on_code: Callable[[str], None] | None
    #: The approval code this node shows (approval mode only).
    shown: str = ""
    #: Desks whose last word was no (by address), and desks that hold this node.
    closed: dict[str, wire.JoinRefused] = field(default_factory=dict)
    holding: dict[str, DeskSeen] = field(default_factory=dict)
    told: set[str] = field(default_factory=set)

    @property
    def approval(self) -> bool:
        return self.code is None and not self.proof

    def new_shown(self) -> None:
        self.shown = new_approval_code()
        if self.on_code is not None:
            self.on_code(self.shown)

    def _hello(self) -> tuple[wire.JoinHello, spake2.SPAKE2_A | None]:
        import spake2  # when a node asks to join, not at every node's start (~0.06 s)

        hello = wire.JoinHello(
            name=self.name, key=self.key.public, version=meshd.__version__, proof=self.proof,
            protocol=PROTOCOL,
        )  # fmt: skip
        if self.proof:
            return hello, None
        if self.code is not None:
            raw = normal_code(self.code)
            a = spake2.SPAKE2_A(raw.encode(), **INVITE_IDS)
            hello.invite = raw[:INVITE_ID_CHARS]
        else:
            a = spake2.SPAKE2_A(normal_code(self.shown).encode(), **APPROVAL_IDS)
            hello.tag = approval_tag(self.shown, self.key.public)
        hello.spake = a.start()
        return hello, a

    async def once(self, host: str, port: int) -> JoinOutcome | wire.JoinMessage | None:
        """One exchange with the desk at ``host:port``."""
        where = f"{host}:{port}"
        hello, a = self._hello()
        reply = await _ask(self.ctx, host, port, hello, self.timeout)
        session: bytes | None = None
        if a is not None and isinstance(reply, wire.JoinChallenge):
            import spake2

            with contextlib.suppress(spake2.SPAKEError):
                session = a.finish(reply.spake)
            transcript = self.key.public + hello.spake + reply.spake
            if session is None or not hmac.compare_digest(
                reply.confirm, confirm_mac(session, b"member", transcript)
            ):
                return self._wrong(where)
            confirm = wire.JoinConfirm(
                key=self.key.public,
                invite=hello.invite,
                confirm=confirm_mac(session, b"joiner", transcript),
            )
            reply = await _ask(self.ctx, host, port, confirm, self.timeout)
        if isinstance(reply, wire.JoinPending):
            self.holding[where] = DeskSeen(where, printable(reply.cluster), printable(reply.name))
        if isinstance(reply, wire.JoinRefused) and reply.code in FINAL:
            self.closed[where] = reply
        elif isinstance(reply, wire.JoinRefused) and where not in self.told:
            self.told.add(where)  # busy: said once, asked again
            log.warning("the join desk at %s said %s: %s; asking again", where, reply.code,
                        printable(reply.message))  # fmt: skip
        if not isinstance(reply, wire.JoinAccepted):
            return reply
        if a is not None and session is None:
            if where not in self.told:  # a desk that says yes to anyone: no member
                self.told.add(where)
                log.warning("the join desk at %s said yes without proving the code: ignored",
                            where)  # fmt: skip
            return None
        return self._open(reply, session, where)

    def _wrong(self, where: str) -> wire.JoinRefused:
        """A desk derived another key: the code differs (or it is no member). It is not
        asked again: each exchange would be one more online guess of the code (the code
        stays: a new one each time fakes fail would let them keep the owner from typing
        it)."""
        if self.code is not None:
            no = wire.JoinRefused(code="wrong_code", message="wrong pairing code")
            self.closed[where] = no
            return no
        log.warning("the join desk at %s answered with another approval code than this "
                    "node shows: not the member it was approved on", where)  # fmt: skip
        no = wire.JoinRefused(
            code="wrong_code",
            message=f"the join desk at {where} proved another approval code than this node "
            "shows: it is no member where this node was approved",
        )
        self.closed[where] = no
        return no

    def _open(
        self, acc: wire.JoinAccepted, session: bytes | None, where: str
    ) -> JoinOutcome | None:
        with contextlib.suppress(nacl.exceptions.CryptoError, ValueError):
            sealed = acc.sealed_key
            if session is not None:
                sealed = session_box(session).decrypt(sealed)
            cluster_key = nacl.public.SealedBox(curve_private(self.key.seed)).decrypt(sealed)
            if cluster_id_of(cluster_key) != acc.cluster:
                return None
            return JoinOutcome(
                StoredCluster(
                    key=cluster_key, name=acc.name, members=list(acc.members),
                    self_vouch=acc.self_vouch,
                ),
                via=where,
            )  # fmt: skip
        return None


def _verdict(closed: list[wire.JoinRefused]) -> JoinRefusedError:
    for code in _TELLING:
        for no in closed:
            if no.code == code:
                return JoinRefusedError(printable(no.message), code)
    return JoinRefusedError(printable(closed[0].message), printable(closed[0].code, 32))


async def ask_to_join(
    ctx: zmq.asyncio.Context,
    key: NodeKey,
    name: str,
    candidates: Callable[[], list[tuple[str, int]]],
    *,
    code: str | None = None,
    proof: bytes = b"",
    on_code: Callable[[str], None] | None = None,
    on_pending: Callable[[list[DeskSeen]], None] | None = None,
    attempt_timeout: float = 2.0,
    retry_s: float = 1.0,
    search_s: float | None = None,
    refuse_after_s: float = 0.0,
) -> JoinOutcome:
    """Ask the join desks ``candidates()`` returns (``(host, port)``, asked again every
    ``retry_s``) until one proves itself and lets this node in.

    With neither ``code`` nor ``proof`` the node asks for approval: it makes an approval
    code, hands it to ``on_code`` and calls
    ``on_pending`` each time another desk holds it. Raises :class:`JoinRefusedError`
    once every desk found refused for good (not before ``refuse_after_s``), and
    :class:`NoClusterFoundError` when none answered within ``search_s`` (None: no bound).
    """
    j = _Joiner(ctx, key, name, code, proof, attempt_timeout, on_code)
    if j.approval:
        j.new_shown()
    started, asked, answered = time.monotonic(), set[str](), False
    while True:
        cands = list(dict.fromkeys(candidates()))
        ask = [(h, p) for h, p in cands if f"{h}:{p}" not in j.closed]
        asked.update(f"{h}:{p}" for h, p in cands)
        held = len(j.holding)
        # One desk at a time: one desk found twice (a seed and Bonjour) must not see two
        # exchanges of this node interleave (the second would void the first's session).
        for h, p in ask:
            g = await j.once(h, p)
            if isinstance(g, JoinOutcome):
                return g
            answered = answered or g is not None
        if on_pending is not None and len(j.holding) > held:
            on_pending(list(j.holding.values()))
        elapsed = time.monotonic() - started
        closed = [j.closed[f"{h}:{p}"] for h, p in cands if f"{h}:{p}" in j.closed]
        if cands and len(closed) == len(cands) and elapsed >= refuse_after_s:
            raise _verdict(closed)
        if not answered and search_s is not None and elapsed >= search_s:
            raise NoClusterFoundError(elapsed, sorted(asked))
        await asyncio.sleep(retry_s)


async def whois(
    ctx: zmq.asyncio.Context, host: str, port: int, timeout: float = 2.0
) -> bytes | None:
    """The Ed25519 key the node at join port ``host:port`` claims (None: no answer, or
    a node older than :class:`~meshd.transport.wire.JoinWho`). Claimed, not proven:
    the CURVE handshake with that key proves it."""
    reply = await _ask(ctx, host, port, wire.JoinWho(), timeout)
    if isinstance(reply, wire.JoinIdent) and len(reply.key) == 32:
        return reply.key
    return None

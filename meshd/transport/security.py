"""CURVE encryption and ZAP authentication on every ZeroMQ socket; the files that hold
secrets.

Every node's sockets use **its own** key pair, the X25519 form of its Ed25519 identity
(``meshd.transport.identity``): a binding socket (mesh ROUTER, PUB, data-plane and runner
ROUTERs) is a CURVE server with it, a connecting socket (DEALER, SUB) a CURVE client
with it. A connecting socket must name the public key of the node it dials
(:func:`secure`'s ``server_key``), taken from that node's member entry, so no member can
pose as another's server: only the holder of a node's key completes a handshake as
that node. The ZAP handler admits the client keys of the cluster's members only, so a
node is authenticated as itself on both ends. CurveZMQ encrypts each connection with
fresh short-term keys.

ZAP runs at the handshake only: a receive loop that must stop hearing a removed member
on a connection opened before its removal checks each message's ``User-Id`` (the
client key ZAP admitted it with; :func:`sender_key`) against the members of now.

The **cluster key** (32 random bytes made by the first node, or derived from
``meshd up --secret-file PATH`` with a slow KDF) names the cluster (its id) and, in a
secret-file cluster only, lets its holders vouch for themselves as members.

libzmq reports a failed handshake through socket monitors only (the peer never
reaches ZAP when it used the wrong server key or no CURVE at all);
:class:`HandshakeReporter` counts those events and logs once per socket, endpoint and
reason. A connecting socket's event names the peer it dialled; a binding socket's
names only its own endpoint, because libzmq does not expose the remote address there.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import secrets
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .secret_files import read_private, write_private

if TYPE_CHECKING:
    import zmq.asyncio
    from zmq.auth.base import Authenticator

__all__ = [
    "HANDSHAKE_EVENTS",
    "MIN_SECRET_CHARS",
    "PROTOCOL",
    "SECRET_ENV",
    "ZAP_DOMAIN",
    "CurveKeys",
    "HandshakeReporter",
    "NoServerKey",
    "SecretError",
    "cluster_id_of",
    "cluster_key_from_secret",
    "load_secret",
    "new_secret",
    "read_private",
    "secure",
    "sender_key",
    "start_zap",
    "watch_handshakes",
    "write_private",
    "write_secret",
]

log = logging.getLogger(__name__)

#: The version of the wire protocol between nodes. 2: every node's sockets use its own
#: CURVE key (1: one server key derived from the cluster key, shared by every member).
PROTOCOL = 2
#: Environment variable holding the secret itself (``--secret-file`` wins over it).
SECRET_ENV = "MESHD_SECRET"
#: ZAP domain every meshd socket uses; the handler answers for this domain only.
ZAP_DOMAIN = "meshd"
#: A shorter secret is refused: it could be guessed offline from one captured handshake.
MIN_SECRET_CHARS = 16

#: Monitor events that mean "a peer could not complete the handshake".
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_REASONS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_auth",
}


class SecretError(ValueError):
    """The cluster secret is missing, unreadable or too weak."""


class NoServerKey(ValueError):
    """A connecting socket was asked to dial a node whose key this node does not hold
    (not a member here, or not yet): it must not be dialled at all."""


@dataclass(frozen=True)
class CurveKeys:
    """A node's CurveZMQ key pair (Z85, 40 bytes each): the server key of every socket
    it binds and the client key of every socket it connects."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print secret keys into a log
        return "CurveKeys(<keys hidden>)"

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh random pair (tools and tests that are no node)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


#: Argon2id for a secret a person may have typed: one guess costs ~0.2 s and 64 MiB, so
#: a passphrase is not found by trying a dictionary against a captured handshake.
_KDF = {"time_cost": 3, "memory_cost": 64 * 1024, "parallelism": 1, "hash_len": 32}
_KDF_SALT = b"meshd-cluster-key-v1"


def cluster_key_from_secret(secret: str | bytes) -> bytes:
    """The cluster key a secret stands for (the same on every node; slow on purpose)."""
    from argon2.low_level import Type, hash_secret_raw

    raw = secret.encode() if isinstance(secret, str) else secret
    raw = raw.strip()
    if len(raw) < MIN_SECRET_CHARS:
        raise SecretError(
            f"the cluster secret is {len(raw)} characters; at least {MIN_SECRET_CHARS} "
            "are needed (make one with `meshctl secret new`)"
        )
    return hash_secret_raw(raw, _KDF_SALT, type=Type.ID, **_KDF)


def cluster_id_of(cluster_key: bytes) -> str:
    """The public name of a cluster key (Bonjour, logs): 16 hex characters."""
    return hashlib.blake2b(cluster_key, digest_size=8, person=b"meshd-cluster").hexdigest()


def new_secret() -> str:
    """A fresh secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


def write_secret(path: Path, *, force: bool = False) -> str:
    """Write a fresh secret to ``path`` (mode 0600); refuse to overwrite unless ``force``."""
    if path.exists() and not force:
        raise SecretError(f"{path} exists; pass --force to replace it")
    secret = new_secret()
    write_private(path, (secret + "\n").encode(), replace=force)
    return secret


def load_secret(path: str | Path | None, env: Mapping[str, str] | None = None) -> str | None:
    """The secret from ``path``, else from ``$MESHD_SECRET``, else ``None`` (open cluster).

    Raises :class:`SecretError` when the file cannot be read or the secret is too weak.
    """
    if path is not None:
        p = Path(path).expanduser()
        try:
            text = read_private(p).decode("utf-8", "replace")
        except OSError as e:
            raise SecretError(f"cannot read the secret file {p}: {e.strerror}") from None
    else:
        text = (os.environ if env is None else env).get(SECRET_ENV, "")
        if not text:
            return None
    text = text.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise SecretError(
            f"the cluster secret is {len(text)} characters; at least {MIN_SECRET_CHARS} "
            "are needed (make one with `meshctl secret new`)"
        )
    return text


def secure(
    sock: zmq.Socket, keys: CurveKeys | None, *, server: bool, server_key: bytes | None = None
) -> None:
    """Turn on CURVE for ``sock`` with this node's ``keys``: ``server`` for sockets that
    bind, else a client that will dial the node whose public key is ``server_key``.

    A no-op without keys (an open cluster). Must run before ``bind``/``connect`` (a
    SUB that dials several nodes sets ``curve_serverkey`` again before each connect).
    Raises :class:`NoServerKey` for a client socket with no ``server_key``.
    """
    if keys is None:
        return
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    if server:
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
    elif server_key is None:
        raise NoServerKey("no key is known for the node to dial")
    else:
        sock.curve_serverkey = server_key


def sender_key(frame: zmq.Frame) -> bytes:
    """The CURVE client key (Z85) a received message's sender was admitted with
    (b"" without CURVE): what ZAP answered as its ``User-Id``."""
    try:
        uid = frame.get("User-Id")
    except zmq.ZMQError:
        return b""
    return uid.encode() if isinstance(uid, str) else bytes(uid or b"")


class _ClientKeyCheck:
    """ZAP credentials provider: only admitted client keys get in."""

    def __init__(
        self,
        admits: Callable[[bytes], bool],
        on_denied: Callable[[], None],
        on_denied_at: Callable[[str], None] | None = None,
    ) -> None:
        self._admits = admits
        self._on_denied = on_denied
        self._on_denied_at = on_denied_at
        #: The address of the ZAP request being answered (requests are answered one at
        #: a time; the credentials callback is not told it).
        self.address = ""

    def callback(self, domain: str, key: bytes) -> bool:
        ok = self._admits(key)
        if not ok:
            self._on_denied()
            if self._on_denied_at is not None:
                self._on_denied_at(self.address)
        return ok


def start_zap(
    ctx: zmq.Context,
    admits: Callable[[bytes], bool],
    on_denied: Callable[[], None],
    *,
    on_denied_at: Callable[[str], None] | None = None,
) -> Authenticator:
    """Start the ZAP handler of ``ctx`` (asyncio or threaded, matching the context):
    a CURVE client whose public key (Z85) ``admits`` refuses is turned away, and
    ``on_denied`` called (``on_denied_at`` too, with the client's IP address).

    Returns the authenticator; call its ``stop()`` at shutdown.
    """
    import zmq.asyncio

    auth: Authenticator
    if isinstance(ctx, zmq.asyncio.Context):
        from zmq.auth.asyncio import AsyncioAuthenticator

        auth = AsyncioAuthenticator(ctx)
    else:
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
    auth.start()
    check = _ClientKeyCheck(admits, on_denied, on_denied_at)
    handle = auth.handle_zap_message

    def handle_noting_address(msg: list[bytes]) -> Coroutine[Any, Any, None]:
        # pyzmq tells the credentials callback no address; frame 3 of a ZAP request is
        # the client's. Requests are answered in turn, so the note holds for this one.
        check.address = msg[3].decode(errors="replace") if len(msg) > 3 else ""
        return handle(msg)

    auth.handle_zap_message = handle_noting_address  # type: ignore[method-assign]  # a wrapper
    auth.configure_curve_callback(ZAP_DOMAIN, check)
    return auth


_PROTOCOL_ERRORS: dict[int, str] = {
    getattr(zmq, n): n.removeprefix("PROTOCOL_ERROR_").lower()
    for n in dir(zmq)
    if n.startswith("PROTOCOL_ERROR_")
}


def _detail(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return _PROTOCOL_ERRORS.get(value, f"protocol error {value:#x}")
    return zmq.strerror(value) if value else "no detail"


class HandshakeReporter:
    """Counts failed handshakes and logs each (socket, endpoint, reason) once."""

    def __init__(self, count: Callable[[str, str], None], logger: logging.Logger = log) -> None:
        self._count = count
        self._log = logger
        self._seen: set[tuple[str, str, str]] = set()

    def event(self, socket: str, frames: list[bytes], *, bound: bool = True) -> str | None:
        """Handle one monitor message of ``socket``; the reason counted, or ``None``.

        ``bound``: the socket listens, so the event names our endpoint, not the peer's.
        """
        try:
            ev = parse_monitor_message(frames)
        except Exception:
            return None
        reason = _REASONS.get(ev["event"])
        if reason is None:
            return None
        self._count(socket, reason)
        endpoint = ev["endpoint"].decode(errors="replace")
        key = (socket, endpoint, reason)
        if key not in self._seen:
            self._seen.add(key)
            detail = _detail(ev["event"], ev["value"])
            if bound:
                # The endpoint is ours: who connected is not known, only that the
                # handshake failed (a member may still dial a port a gone node had).
                self._log.warning(
                    "%s: a connection to %s failed the CURVE handshake (%s); who made it "
                    "is not known: a machine without this cluster's keys, a removed "
                    "member, a meshd older than protocol %d, or a node still dialling "
                    "an address a node that left had; counted in dropped[%s][%s], "
                    "logged once",
                    socket, endpoint, detail, PROTOCOL, socket, reason,
                )  # fmt: skip
            else:
                self._log.warning(
                    "%s: the CURVE handshake with %s failed (%s): that node is not the "
                    "member this node dialled, no member any more, or runs a meshd older "
                    "than protocol %d; nothing is exchanged with it",
                    socket, endpoint, detail, PROTOCOL,
                )  # fmt: skip
        return reason

    def denied(self, socket: str) -> None:
        """A peer passed the handshake with a key that is not the cluster's."""
        self._count(socket, "zap_denied")
        key = (socket, "", "zap_denied")
        if key not in self._seen:
            self._seen.add(key)
            self._log.warning("%s: refused a peer whose CURVE key is no member's", socket)


async def watch_handshakes(
    sock: zmq.asyncio.Socket, name: str, reporter: HandshakeReporter, *, bound: bool = True
) -> None:
    """Report the failed handshakes of an asyncio socket until cancelled."""
    mon = sock.get_monitor_socket(HANDSHAKE_EVENTS)
    try:
        while True:
            reporter.event(name, await mon.recv_multipart(), bound=bound)
    except zmq.ZMQError:
        pass  # the socket closed under us
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        mon.close(linger=0)

"""CURVE encryption and ZAP authentication on every ZeroMQ socket; the files that hold
secrets.

Every member holds the **cluster key** (32 random bytes made by the first node, handed
to each node it admits; or derived from ``meshd up --secret-file PATH`` with a slow KDF)
and derives from it the *server* pair that every binding socket uses (mesh ROUTER, PUB,
data-plane and runner ROUTERs): a socket that connects must know the server's public
key to open a CURVE handshake at all, so only members can. A connecting socket (DEALER,
SUB) uses its node's *own* client pair (``meshd.transport.identity``), and the ZAP
handler admits only the client keys of the cluster's members: a node is authenticated
as itself, not as "someone with the secret". CurveZMQ encrypts each connection with
fresh short-term keys.

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
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

if TYPE_CHECKING:
    import zmq.asyncio
    from zmq.auth.base import Authenticator

__all__ = [
    "HANDSHAKE_EVENTS",
    "MIN_SECRET_CHARS",
    "SECRET_ENV",
    "ZAP_DOMAIN",
    "ClusterKeys",
    "HandshakeReporter",
    "SecretError",
    "admits_only",
    "cluster_id_of",
    "cluster_key_from_secret",
    "cluster_keys",
    "derive_keys",
    "load_secret",
    "new_secret",
    "read_private",
    "secure",
    "start_zap",
    "watch_handshakes",
    "write_private",
    "write_secret",
]

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class ClusterKeys:
    """CurveZMQ key pairs derived from the cluster secret (Z85, 40 bytes each)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:  # never print secret keys into a log
        return "ClusterKeys(<keys hidden>)"


def _pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    seed = hashlib.blake2b(secret, digest_size=32, person=b"meshd-curve-v1", salt=role).digest()
    sk = z85.encode(seed)
    return zmq.curve_public(sk), sk


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


def cluster_keys(cluster_key: bytes, client: tuple[bytes, bytes] | None = None) -> ClusterKeys:
    """A node's socket keys: the server pair of the cluster key, and the node's own
    client pair (``client``; None: one derived from the cluster key, for tools)."""
    spub, ssec = _pair(cluster_key, b"server")
    cpub, csec = client if client is not None else _pair(cluster_key, b"client")
    return ClusterKeys(spub, ssec, cpub, csec)


def derive_keys(secret: str | bytes) -> ClusterKeys:
    """The socket keys of a tool that holds only the cluster's secret."""
    return cluster_keys(cluster_key_from_secret(secret))


def new_secret() -> str:
    """A fresh secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


def write_private(path: Path, data: bytes, *, replace: bool = False) -> None:
    """Write ``data`` to a new file only this user can read (0600).

    Created with ``O_EXCL|O_NOFOLLOW``: never through a symlink someone planted, never
    over a file that is there. ``replace`` writes a new file beside it first and renames
    it over the old one (atomic; a symlink at ``path`` is replaced, not followed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp") if replace else path
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(target, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if replace:
            os.replace(target, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(target)
        raise


def read_private(path: Path) -> bytes:
    """The bytes of a secret file (not through a symlink; warns when others can read it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("secret file %s is readable by other users; chmod 600 it", path)
        return f.read()


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


def secure(sock: zmq.Socket, keys: ClusterKeys | None, *, server: bool) -> None:
    """Turn on CURVE for ``sock``: ``server`` for sockets that bind, else client.

    A no-op without keys (an open cluster). Must run before ``bind``/``connect``.
    """
    if keys is None:
        return
    if server:
        sock.curve_server = True
        sock.curve_publickey = keys.server_public
        sock.curve_secretkey = keys.server_secret
        sock.zap_domain = ZAP_DOMAIN.encode()
    else:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret


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


def admits_only(keys: ClusterKeys) -> Callable[[bytes], bool]:
    """The admission rule of a cluster whose members all hold ``keys``' client pair."""
    want = keys.client_public
    return lambda key: hmac.compare_digest(key, want)


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
                self._log.warning(
                    "%s: a peer failed the CURVE handshake on %s (%s): it has no cluster "
                    "secret or another one; counted in dropped[%s][%s], logged once",
                    socket, endpoint, detail, socket, reason,
                )  # fmt: skip
            else:
                self._log.warning(
                    "%s: the CURVE handshake with %s failed (%s): that peer has no cluster "
                    "secret or another one; nothing is exchanged with it",
                    socket, endpoint, detail,
                )  # fmt: skip
        return reason

    def denied(self, socket: str) -> None:
        """A peer passed the handshake with a key that is not the cluster's."""
        self._count(socket, "zap_denied")
        key = (socket, "", "zap_denied")
        if key not in self._seen:
            self._seen.add(key)
            self._log.warning("%s: refused a peer whose CURVE key is not the cluster's", socket)


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

"""The cluster secret: CURVE encryption and ZAP authentication on every ZeroMQ socket.

One shared secret (``meshd up --secret-file PATH`` or ``MESHD_SECRET``) is the whole
membership rule. Every member derives the same two CurveZMQ key pairs from it:

* the *server* pair, used by every socket that binds (mesh ROUTER, PUB, data-plane
  and runner ROUTERs);
* the *client* pair, used by every socket that connects (DEALERs, SUB).

A connecting socket must know the server's public key to open a CURVE handshake at
all, and the ZAP handler then accepts only the cluster's client key, which the client
proves it holds. Both keys come out of the secret, so a node without it (or with
another one) cannot read gossip or activations, nor inject anything. Sharing the
long-term pairs among members costs no confidentiality between sessions: CurveZMQ
encrypts each connection with fresh short-term keys.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "HANDSHAKE_EVENTS",
    "MIN_SECRET_CHARS",
    "SECRET_ENV",
    "ZAP_DOMAIN",
    "ClusterKeys",
    "HandshakeReporter",
    "SecretError",
    "derive_keys",
    "load_secret",
    "new_secret",
    "secure",
    "start_zap",
    "watch_handshakes",
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
_REASONS = {
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
        return "ClusterKeys(<derived from the cluster secret>)"


def _pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    seed = hashlib.blake2b(secret, digest_size=32, person=b"meshd-curve-v1", salt=role).digest()
    sk = z85.encode(seed)
    return zmq.curve_public(sk), sk


def derive_keys(secret: str | bytes) -> ClusterKeys:
    """The cluster's key pairs from its secret: same secret, same keys, on every node."""
    raw = secret.encode() if isinstance(secret, str) else secret
    raw = raw.strip()
    if len(raw) < MIN_SECRET_CHARS:
        raise SecretError(
            f"the cluster secret is {len(raw)} characters; at least {MIN_SECRET_CHARS} "
            "are needed (make one with `meshctl secret new`)"
        )
    spub, ssec = _pair(raw, b"server")
    cpub, csec = _pair(raw, b"client")
    return ClusterKeys(spub, ssec, cpub, csec)


def new_secret() -> str:
    """A fresh secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


def write_secret(path: Path, *, force: bool = False) -> str:
    """Write a fresh secret to ``path`` (mode 0600); refuse to overwrite unless ``force``."""
    if path.exists() and not force:
        raise SecretError(f"{path} exists; pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = new_secret()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)
    return secret


def load_secret(path: str | Path | None, env: Mapping[str, str] | None = None) -> str | None:
    """The secret from ``path``, else from ``$MESHD_SECRET``, else ``None`` (open cluster).

    Raises :class:`SecretError` when the file cannot be read or the secret is too weak.
    """
    if path is not None:
        p = Path(path).expanduser()
        try:
            text = p.read_text()
        except OSError as e:
            raise SecretError(f"cannot read the secret file {p}: {e.strerror}") from None
        mode = p.stat().st_mode
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("secret file %s is readable by other users; chmod 600 it", p)
    else:
        text = (os.environ if env is None else env).get(SECRET_ENV, "")
        if not text:
            return None
    derive_keys(text)  # validates
    return text.strip()


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
    """ZAP credentials provider: only the cluster's client key gets in."""

    def __init__(self, keys: ClusterKeys, on_denied: Callable[[], None]) -> None:
        self._want = keys.client_public
        self._on_denied = on_denied

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self._want)
        if not ok:
            self._on_denied()
        return ok


def start_zap(ctx: zmq.Context, keys: ClusterKeys, on_denied: Callable[[], None]):
    """Start the ZAP handler of ``ctx`` (asyncio or threaded, matching the context).

    Returns the authenticator; call its ``stop()`` at shutdown.
    """
    import zmq.asyncio

    if isinstance(ctx, zmq.asyncio.Context):
        from zmq.auth.asyncio import AsyncioAuthenticator

        auth = AsyncioAuthenticator(ctx)
    else:
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, _ClientKeyCheck(keys, on_denied))
    return auth


_PROTOCOL_ERRORS = {
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
    sock: zmq.Socket, name: str, reporter: HandshakeReporter, *, bound: bool = True
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

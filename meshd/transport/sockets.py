"""The socket edge: every ZeroMQ socket meshd opens is made, secured and read here.

Two kinds of traffic, two option sets (:class:`SocketOptions`):

* :data:`CONTROL`: gossip (mesh ROUTER, PUB, SUB, per-peer DEALERs). Frames up to
  :data:`~meshd.transport.wire.ZMQ_MAX_MSG_SIZE`; a short linger so a goodbye leaves
  before the socket closes.
* :data:`DATA`: the data plane (the API node's ROUTER and DEALERs, every runner's
  ROUTER and DEALERs). Frames up to :data:`~meshd.transport.wire.MAX_DATA_FRAME`
  (activations of a long prompt); no linger: a request whose peer is gone is ended by
  its own timeouts, never by a socket that will not close.

Both get ZMTP heartbeats (a dead link is noticed in seconds and redialled at once when
the network heals) and CURVE when the cluster has keys (:func:`~.security.secure`).
:class:`DealerCache` keeps the DEALERs of the data plane, one per endpoint, least
recently used first out. :func:`decode_frame` is the one door from a received frame
to a typed message: what fails is dropped and counted, never raised.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import zmq

from . import wire
from .addresses import choose_address
from .security import CurveKeys, NoServerKey, secure

#: The socket class of a context: ``zmq.asyncio.Socket`` for an asyncio one.
S = TypeVar("S", bound="zmq.Socket[Any]")

__all__ = [
    "CONTROL",
    "DATA",
    "MAX_DEALERS",
    "DealerCache",
    "SocketOptions",
    "bind",
    "configure",
    "decode_frame",
    "endpoint",
    "free_port_pair",
    "open_socket",
]

#: ZMTP heartbeats: a connection silent this long is dropped and redialled, so a healed
#: network is used again at once instead of after TCP's retransmission backoff.
HEARTBEAT_IVL_MS = 500
HEARTBEAT_TIMEOUT_MS = 2000
#: Redial quickly, and give up on a connect attempt that hangs (SYN lost in a partition).
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 500
CONNECT_TIMEOUT_MS = 500
#: Messages queued towards one data-plane peer before sends are dropped (and counted):
#: a peer that is gone must not grow a queue without bound, and a live one never lags
#: this far behind (one message a token per request).
DATA_SNDHWM = 1000
#: Connections one process keeps to runners and API nodes (least recently used go):
#: a flood of made-up reply addresses must not use up ZeroMQ's sockets (1023) nor keep
#: dead peers being redialled.
MAX_DEALERS = 64


@dataclass(frozen=True, slots=True)
class SocketOptions:
    """What a socket of one kind of traffic is set up with."""

    #: ZMQ_MAXMSGSIZE: libzmq disconnects a peer that sends more.
    max_msg: int
    #: How long a closing socket keeps trying to deliver what it holds.
    linger_ms: int
    #: Send high-water mark; None keeps ZeroMQ's default (1000).
    sndhwm: int | None = None


CONTROL = SocketOptions(max_msg=wire.ZMQ_MAX_MSG_SIZE, linger_ms=500)
#: Room for the header beside the largest tensor frame.
DATA = SocketOptions(max_msg=wire.MAX_DATA_FRAME + (1 << 20), linger_ms=0, sndhwm=DATA_SNDHWM)


def configure(sock: zmq.Socket, options: SocketOptions = CONTROL) -> None:
    """Bounded frames, linger, heartbeats and quick redial (before bind/connect)."""
    sock.setsockopt(zmq.MAXMSGSIZE, options.max_msg)
    sock.setsockopt(zmq.LINGER, options.linger_ms)
    if options.sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, options.sndhwm)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)


def open_socket(
    ctx: zmq.Context[S],
    kind: int,
    options: SocketOptions,
    keys: CurveKeys | None,
    *,
    server: bool,
    server_key: bytes | None = None,
) -> S:
    """A socket of ``kind`` (``zmq.ROUTER``...), configured and secured: ``server`` for
    one that binds, else it connects to the node whose CURVE key is ``server_key``.
    Works for asyncio and plain contexts alike."""
    sock = ctx.socket(kind)
    try:
        configure(sock, options)
        secure(sock, keys, server=server, server_key=server_key)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bind(sock: zmq.Socket, host: str, port: int = 0) -> int:
    """Bind ``sock`` on ``host`` (``port`` 0: one the OS picks); the bound port."""
    h = f"[{host}]" if ":" in host else host
    sock.bind(f"tcp://{h}:{port}")
    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


def free_port_pair(host: str, tries: int = 64) -> int:
    """A port P such that P and P + 1 are both free on ``host`` now (a node's mesh and
    join ports, when it was told to take any)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = "" if host in ("0.0.0.0", "::") else host
    for _ in range(tries):
        with socket.socket(family, socket.SOCK_STREAM) as a:
            a.bind((bind_host, 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket(family, socket.SOCK_STREAM) as b:
                try:
                    b.bind((bind_host, port + 1))
                except OSError:
                    continue
        return port
    raise OSError(f"no two free consecutive ports on {host}")


def endpoint(addr: wire.Addr, own_addresses: list[str]) -> str:
    """ZeroMQ address of ``addr`` as seen from a host with ``own_addresses``."""
    host = choose_address(own_addresses, addr.addresses) if addr.addresses else "127.0.0.1"
    if host == "127.0.0.1" and host not in addr.addresses and addr.addresses:
        host = next((a for a in addr.addresses if a in own_addresses), addr.addresses[0])
    return f"tcp://[{host}]:{addr.port}" if ":" in host else f"tcp://{host}:{addr.port}"


class DealerCache(Generic[S]):
    """Connected DEALERs, one per peer endpoint, at most :data:`MAX_DEALERS` of them
    (the least recently used is closed first). Used from one thread or loop."""

    def __init__(
        self,
        ctx: zmq.Context[S],
        *,
        keys: CurveKeys | None,
        own_addresses: list[str],
        server_key: Callable[[str], bytes | None] = lambda node: None,
        options: SocketOptions = DATA,
        limit: int = MAX_DEALERS,
    ) -> None:
        self._ctx = ctx
        self._keys = keys
        #: Node id -> its CURVE key (Z85), None for a node that is no member here.
        self._server_key = server_key
        self._own = own_addresses
        self._options = options
        self._limit = limit
        self._socks: OrderedDict[str, S] = OrderedDict()
        #: Addr -> (endpoint, socket slot), resolved once per address, not per message.
        self._resolved: OrderedDict[tuple, tuple[str, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._socks)

    def to(self, addr: wire.Addr) -> S:
        """The DEALER connected to ``addr`` (connecting one when there is none).

        Raises ``zmq.ZMQError`` for an address ZeroMQ cannot connect to (it came from
        the network: it may be anything), :class:`~.security.NoServerKey` for a node
        that is no member here; nothing is left open then. A DEALER is kept per node
        and endpoint: the key that must answer is part of what it dials.
        """
        key = (addr.node, addr.port, *addr.addresses)
        hit = self._resolved.get(key)
        if hit is None:
            ep = endpoint(addr, self._own)
            hit = self._resolved[key] = (ep, f"{addr.node}@{ep}")
            if len(self._resolved) > 4 * self._limit:
                self._resolved.popitem(last=False)
        ep, slot = hit
        sock = self._socks.get(slot)
        if sock is not None:
            self._socks.move_to_end(slot)
            return sock
        server_key = self._server_key(addr.node) if self._keys is not None else None
        if self._keys is not None and server_key is None:
            raise NoServerKey(f"node {addr.node!r} is no member here")
        if len(self._socks) >= self._limit:
            self._socks.popitem(last=False)[1].close(linger=0)
        sock = open_socket(
            self._ctx, zmq.DEALER, self._options, self._keys, server=False, server_key=server_key
        )
        try:
            sock.connect(ep)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._socks[slot] = sock
        return sock

    def drop_node(self, node: str) -> None:
        """Close the DEALERs to ``node`` (it is no member any more)."""
        for slot in [s for s in self._socks if s.split("@", 1)[0] == node]:
            self._socks.pop(slot).close(linger=0)

    def close(self) -> None:
        """Close every DEALER."""
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()


M = TypeVar("M")


def decode_frame(
    frame: bytes | memoryview,
    on_drop: Callable[[str], None],
    decode: Callable[[bytes | memoryview], M],
) -> M | None:
    """The message in one header frame as this socket's plane reads it (``decode``:
    ``wire.decode_gossip``, ``decode_stage``, ``decode_output``), or None after
    counting why it was dropped (``on_drop(reason)``: ``oversized``, ``malformed``...)."""
    try:
        return decode(frame)
    except wire.FrameError as e:
        on_drop(e.reason)
        return None

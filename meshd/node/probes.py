"""Whether a peer's ports answer from this node (for ``meshctl doctor``).

A bare TCP connect would tell "answers or not", but libzmq takes a connection that
closes before its handshake for a failed handshake, and the peer would count and log
it as an intruder. So each port is opened the way the node itself opens it: a ZeroMQ
socket of the matching type, with this node's own CURVE keys, watched through a
monitor until the handshake completes, fails, or the probe's time is up. Nothing is
sent; the socket closes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from meshd.transport.security import HANDSHAKE_EVENTS, CurveKeys, NoServerKey
from meshd.transport.sockets import CONTROL, open_socket

from .diagnosis import PortCheck

__all__ = ["MAX_PROBES", "PROBE_TIMEOUT_S", "Target", "probe_all", "probe_port"]

#: How long one port gets: a LAN answers in milliseconds; a dropped SYN never does.
PROBE_TIMEOUT_S = 1.5
#: At most this many ports per diagnosis (32 peers x mesh, pub, data), and this many at
#: once: a doctor call must not open hundreds of sockets on the node's loop.
MAX_PROBES = 96
CONCURRENCY = 24

_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CLOSED | HANDSHAKE_EVENTS


@dataclass(frozen=True)
class Target:
    """One port of one peer."""

    node: str
    #: ``mesh`` and ``data`` are ROUTERs, ``pub`` a PUB.
    port_name: str
    host: str
    port: int
    #: The CURVE key of the node (None: an open cluster, or no member here).
    key: bytes | None = None


async def probe_port(
    ctx: zmq.asyncio.Context, keys: CurveKeys | None, t: Target, timeout: float
) -> PortCheck:
    """Open ``t`` as a peer would and say how far the handshake got."""
    kind = zmq.SUB if t.port_name == "pub" else zmq.DEALER
    try:
        sock = open_socket(ctx, kind, CONTROL, keys, server=False, server_key=t.key)
    except NoServerKey:
        return PortCheck(
            node=t.node, port_name=t.port_name, host=t.host, port=t.port,
            outcome="not_member", detail="no member key for this node here",
        )  # fmt: skip
    sock.setsockopt(zmq.LINGER, 0)
    # One try: a refused connect is retried by libzmq, which would only mask the answer.
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    mon = sock.get_monitor_socket(_EVENTS)
    connected = False
    outcome, detail = "no_answer", ""
    try:
        h = f"[{t.host}]" if ":" in t.host else t.host
        sock.connect(f"tcp://{h}:{t.port}")
        async with asyncio.timeout(timeout):
            while True:
                ev = parse_monitor_message(await mon.recv_multipart())
                if ev["event"] == zmq.EVENT_CONNECTED:
                    connected = True
                elif ev["event"] == zmq.EVENT_CLOSED and not connected:
                    break  # refused, or no answer within libzmq's connect timeout
                elif ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    outcome = "ok"
                    break
                elif ev["event"] & HANDSHAKE_EVENTS:
                    outcome, detail = "handshake_failed", zmq.strerror(ev["value"])
                    break
    except TimeoutError:
        if connected:
            outcome, detail = "handshake_failed", "no handshake in time"
    except zmq.ZMQError as e:  # a host the card named that cannot be dialled at all
        detail = str(e)
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)
    return PortCheck(
        node=t.node,
        port_name=t.port_name,
        host=t.host,
        port=t.port,
        outcome=outcome,
        detail=detail,
    )


async def probe_all(
    ctx: zmq.asyncio.Context,
    keys: CurveKeys | None,
    targets: list[Target],
    timeout: float = PROBE_TIMEOUT_S,
) -> list[PortCheck]:
    """Probe ``targets`` (the first :data:`MAX_PROBES`), :data:`CONCURRENCY` at once."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(t: Target) -> PortCheck:
        async with gate:
            return await probe_port(ctx, keys, t, timeout)

    return list(await asyncio.gather(*(one(t) for t in targets[:MAX_PROBES])))

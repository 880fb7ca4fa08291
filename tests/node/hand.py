"""A member made by hand: a test that holds the cluster's secret writes every message.

It gets its own key admitted at a node's join desk with a proof (as a node started with
the secret file does), then speaks meshd's wire protocol over CURVE with that key.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import msgspec
import zmq

from meshd.crdt.hlc import HLC
from meshd.crdt.lww import Entry
from meshd.crdt.views import encode
from meshd.transport import wire
from meshd.transport.identity import NodeKey, curve_public_of, member_proof, sign_entry
from meshd.transport.security import (
    PROTOCOL,
    CurveKeys,
    cluster_id_of,
    cluster_key_from_secret,
    secure,
)
from tests.cluster import NodeProc


@functools.cache
def _cluster_key(secret: str) -> bytes:
    # Argon2, slow on purpose (~0.6 s here): a test making a hundred members pays once.
    return cluster_key_from_secret(secret)


class HandMember:
    """A member whose every message the test writes: it holds the cluster's secret, so a
    join desk admits its key; then it speaks gossip by hand over CURVE."""

    def __init__(self, secret_file: Path, node: NodeProc) -> None:
        self.ctx = zmq.Context()
        self.key = NodeKey.generate()
        self.cluster_key = _cluster_key(secret_file.read_text())
        self.node = node
        self.introduce()
        self._server_keys: dict[int, bytes] = {}
        self.clock = HLC()

    @property
    def server_key(self) -> bytes:
        """The CURVE key of the node this member talks to now (``self.node``, which a
        test may point elsewhere): what a socket dialling it names."""
        port = self.node.mesh_port
        if port not in self._server_keys:
            ident = self.join(wire.JoinWho())
            assert isinstance(ident, wire.JoinIdent), ident
            self._server_keys[port] = curve_public_of(ident.key)
        return self._server_keys[port]

    def introduce(self) -> None:
        """Vouch for this member's key at the node's join desk (the secret file's way)."""
        reply = self.join(wire.JoinHello(
            name="mallory", key=self.key.public,
            proof=member_proof(self.cluster_key, self.key.public), protocol=PROTOCOL,
        ))  # fmt: skip
        assert isinstance(reply, wire.JoinAccepted), reply

    def join(self, msg: wire.JoinMessage) -> wire.JoinMessage | None:
        """One message to the node's join desk (plain ZeroMQ), its answer."""
        return self.ask(self.ctx, self.node, msg)

    @staticmethod
    def ask(ctx: zmq.Context, node: NodeProc, msg: wire.JoinMessage) -> wire.JoinMessage | None:
        """One message to ``node``'s join desk (plain ZeroMQ), its answer."""
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVTIMEO, 3000)
        d.connect(f"tcp://127.0.0.1:{node.mesh_port + 1}")
        try:
            for _ in range(50):
                d.send(wire.encode(msg))
                reply = msgspec.msgpack.decode(d.recv(), type=wire.JoinMessage)
                # The desk's rate limit (a test making many members meets it): slow
                # down, as told, like a real joiner.
                if not (isinstance(reply, wire.JoinRefused) and reply.code == "busy"):
                    return reply
                time.sleep(0.1)
            return reply
        except zmq.Again:
            return None
        finally:
            d.close()

    def hello(self, entries: list[Entry]) -> wire.GossipMessage | None:
        """A ``Hello`` carrying ``entries`` to the node's mesh ROUTER, over CURVE with
        this member's own key; the answer."""
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVTIMEO, 3000)
        secure(d, self.keys(), server=False, server_key=self.server_key)
        d.connect(f"tcp://127.0.0.1:{self.node.mesh_port}")
        hello = wire.Hello(
            sender=self.key.node_id,
            cluster=wire.cluster_hash(cluster_id_of(self.cluster_key)),
            incarnation="x", entries=entries,
        )  # fmt: skip
        try:
            d.send(wire.encode(hello))
            return wire.decode_gossip(d.recv())
        except zmq.Again:
            return None
        finally:
            d.close()

    def forge(self, key: str, value: msgspec.Struct | None, writer: str) -> Entry:
        """An entry claiming ``writer`` wrote it, signed with this member's key."""
        e = Entry(key, self.clock.now(), writer, None if value is None else encode(value))
        return sign_entry(self.key, e)

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def keys(self) -> CurveKeys:
        """This member's socket keys (its own pair)."""
        return CurveKeys(*self.key.curve_pair())

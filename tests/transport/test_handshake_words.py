"""A failed CURVE handshake is logged as what is known: on a bound socket, the endpoint
is this node's own and the other side is unknown, so no peer is blamed."""

from __future__ import annotations

import logging
import struct

import pytest
import zmq

from meshd.transport.security import HandshakeReporter


def test_a_failed_handshake_on_our_port_blames_no_peer(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[tuple[str, str]] = []
    reporter = HandshakeReporter(lambda s, r: counted.append((s, r)), logging.getLogger("t"))
    event = struct.pack("=HI", zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0)
    frames = [event, b"tcp://0.0.0.0:41234"]
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(2):
            assert reporter.event("data", frames) is not None
    assert len(counted) == 2 and len(caplog.records) == 1  # counted each, logged once
    said = caplog.records[0].getMessage()
    assert "a peer" not in said and "who made it is not known" in said
    assert "tcp://0.0.0.0:41234" in said and "a node that left" in said

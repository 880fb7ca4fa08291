"""Pure pieces of issue 6: key derivation, secret loading, rate limiting, admission."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq

from meshd.transport.ratelimit import PeerRateLimiter
from meshd.transport.security import (
    SECRET_ENV,
    CurveKeys,
    NoServerKey,
    SecretError,
    cluster_key_from_secret,
    load_secret,
    new_secret,
    secure,
    write_secret,
)


def test_same_secret_same_cluster_key_and_a_pair_hides_its_secret() -> None:
    s = new_secret()
    k1, k2 = cluster_key_from_secret(s), cluster_key_from_secret(s + "\n")
    assert k1 == k2 and len(k1) == 32
    assert k1 != cluster_key_from_secret(new_secret())
    pair = CurveKeys.generate()
    assert zmq.curve_public(pair.secret) == pair.public
    assert "secret" not in repr(pair).replace("cluster secret", "")


def test_weak_or_missing_secrets_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="at least 16"):
        cluster_key_from_secret("hunter2")
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(tmp_path / "nope")
    assert load_secret(None, env={}) is None
    s = new_secret()
    assert load_secret(None, env={SECRET_ENV: s}) == s


def test_write_secret_is_private_and_never_overwrites(tmp_path: Path) -> None:
    p = tmp_path / "s"
    s = write_secret(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert load_secret(p) == s
    with pytest.raises(SecretError, match="exists"):
        write_secret(p)
    assert write_secret(p, force=True) != s


def test_a_socket_that_dials_names_the_key_that_must_answer() -> None:
    server, client = CurveKeys.generate(), CurveKeys.generate()
    ctx = zmq.Context()
    try:
        srv = ctx.socket(zmq.ROUTER)
        secure(srv, server, server=True)
        port = srv.bind_to_random_port("tcp://127.0.0.1")
        good, bad = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        with pytest.raises(NoServerKey):
            secure(good, client, server=False)  # no key named: never dialled blind
        secure(good, client, server=False, server_key=server.public)
        # A client that names another key than the server's own gets no handshake.
        secure(bad, client, server=False, server_key=CurveKeys.generate().public)
        for d in (good, bad):
            d.connect(f"tcp://127.0.0.1:{port}")
        bad.send(b"from a stranger")
        good.send(b"from a member")
        assert srv.poll(2000)
        assert srv.recv_multipart()[1] == b"from a member"
        assert not srv.poll(300)
    finally:
        ctx.destroy(linger=0)


def test_rate_limiter_buckets_are_per_peer_and_refill() -> None:
    now = [0.0]
    rl = PeerRateLimiter(10, 20, max_peers=2, clock=lambda: now[0])
    assert sum(rl.allow("a") for _ in range(30)) == 20
    assert rl.allow("b")
    now[0] += 0.5
    assert sum(rl.allow("a") for _ in range(10)) == 5
    rl.allow("c")  # evicts the least recently used bucket
    assert len(rl._buckets) == 2

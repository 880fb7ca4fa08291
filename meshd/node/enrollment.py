"""Which cluster a starting node is in, before it opens a single socket of it.

* ``--open``: none (today's open lab cluster: no keys, anyone on the LAN joins).
* ``--secret-file``: the cluster of that secret; the node vouches for itself.
* A node that was in a cluster (its data dir says so): that one.
* A new node: it looks for members (its seeds, Bonjour) for ``settle_s``; finding none
  it starts a new cluster (it is the first machine); finding some, it asks to join
  (``--join CODE``, or waiting for a member's approval) and waits as long as it takes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
import time

import zmq.asyncio

from meshd.transport.discovery import PeerAddr

from .cluster_store import ClusterStore, StoredCluster
from .config import NodeConfig
from .identity import Identity
from .joining import JoinRefusedError, ask_to_join

__all__ = ["enroll", "join_port_of"]

log = logging.getLogger("meshd.join")


def join_port_of(mesh_port: int) -> int:
    """A node's join port: its mesh port + 1 (so a seed ``HOST:PORT`` names both)."""
    return mesh_port + 1


async def enroll(
    cfg: NodeConfig, identity: Identity, ctx: zmq.asyncio.Context
) -> StoredCluster | None:
    """The cluster this node is in (None: an open cluster); may wait for approval."""
    store = ClusterStore(cfg.data_dir)
    if cfg.open:
        return None
    if cfg.secret is not None:
        return await asyncio.to_thread(store.from_secret, cfg.secret, cfg.cluster)
    stored = store.load()
    if stored is not None and cfg.join_code is None:
        return stored
    found: dict[str, PeerAddr] = {}
    disc = await _browse(cfg, identity, found) if cfg.discovery else None
    try:
        cluster = await _find_or_found(cfg, identity, ctx, found)
    finally:
        if disc is not None:
            await disc.stop()
    await asyncio.to_thread(store.save, cluster)
    return cluster


async def _find_or_found(
    cfg: NodeConfig, identity: Identity, ctx: zmq.asyncio.Context, found: dict[str, PeerAddr]
) -> StoredCluster:
    def candidates() -> list[tuple[str, int]]:
        seeds = [(h, join_port_of(p)) for h, p in cfg.peers]
        return seeds + [(p.host, p.join) for p in found.values() if p.join]

    if cfg.join_code is None:
        deadline = time.monotonic() + cfg.settle_s
        while not candidates() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if not candidates():
            cluster = StoredCluster(key=secrets.token_bytes(32), name=cfg.cluster)
            log.info(
                "started a new cluster %r (%s): this is its first node; let others in "
                "with `meshctl approve NAME` or `meshctl invite`", cluster.name, cluster.id,
            )  # fmt: skip
            return cluster

    def pending(message: str) -> None:
        # The id lets the approver check, in `meshctl members` or `meshctl top`, that the
        # node waiting there is this one and not a look-alike of the same name.
        message = f"{message} (this node: {cfg.name}, id {identity.node_id})"
        log.warning("asked to join: %s", message)
        print(f"meshd: {message}", file=sys.stderr, flush=True)

    try:
        outcome = await ask_to_join(
            ctx, identity.key, cfg.name, candidates, code=cfg.join_code, on_pending=pending
        )
    except JoinRefusedError as e:
        raise RuntimeError(f"could not join: {e}") from None
    log.info("joined cluster %r (%s) through %s", outcome.cluster.name, outcome.cluster.id,
             outcome.via)  # fmt: skip
    return outcome.cluster


async def _browse(cfg: NodeConfig, identity: Identity, found: dict[str, PeerAddr]):
    """Bonjour, browse only: every meshd node of any cluster (None where unavailable)."""
    from meshd.transport.discovery import Discovery

    disc = Discovery(
        node_id=identity.node_id,
        name=cfg.name,
        cluster_hash=None,
        mesh_port=0,
        api_port=0,
        version="",
        addresses=[],
        on_peer=lambda p: found.__setitem__(p.node_id, p),
        register=False,
    )
    try:
        await disc.start()
    except Exception as e:  # no multicast here: seeds still work
        log.warning("Bonjour unavailable while looking for a cluster (%s)", e)
        return None
    return disc

"""Which cluster a starting node is in, before it opens a single socket of it.

* ``--open``: none (today's open lab cluster: no keys, anyone on the LAN joins).
* ``--secret-file``: the cluster of that secret; the node vouches for itself.
* A node that was in a cluster (its data dir says so): that one.
* A new node: it looks for members (its seeds, Bonjour) for ``settle_s``; finding none
  it starts a new cluster (it is the first machine); finding some, it asks to join
  (``--join CODE``, or showing an approval code and waiting for a member's approval as
  long as it takes). It stops with a clear error when no desk answers within
  :data:`JOIN_SEARCH_S` or every desk refuses for good (a wrong or used code).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
import time
from typing import TYPE_CHECKING

import zmq.asyncio

from .cluster_store import ClusterStore, StoredCluster
from .config import NodeConfig
from .identity import Identity
from .join_client import DeskSeen, JoinRefusedError, NoClusterFoundError, ask_to_join
from .joining import CODE_CHARS, code_chars, name_problem, normal_code

if TYPE_CHECKING:  # zeroconf (~25 ms) only where discovery runs
    from meshd.transport.discovery import PeerAddr

__all__ = ["enroll", "join_port_of"]

log = logging.getLogger("meshd.join")

#: How long a new node looks for a join desk that answers at all before it says so and
#: stops (a desk that holds it for approval keeps it waiting as long as it takes).
JOIN_SEARCH_S = 15.0


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

    problem = name_problem(cfg.name)
    if problem is not None:
        raise ValueError(f"--name: {problem}")
    code = cfg.join_code
    if code is not None and not (len(normal_code(code)) == CODE_CHARS and code_chars(code)):
        raise ValueError(f"--join {code!r} is no pairing code: `meshctl invite` makes one "
                         "of 12 characters, like ABCD-EFGH-JKMN")  # fmt: skip
    if cfg.join_code is None:
        deadline = time.monotonic() + cfg.settle_s
        while not candidates() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if not candidates():
            cluster = StoredCluster(key=secrets.token_bytes(32), name=cfg.cluster)
            log.info(
                "started a new cluster %r (%s): this is its first node; let others in "
                "with `meshctl approve CODE` or `meshctl invite`", cluster.name, cluster.id,
            )  # fmt: skip
            return cluster
    what = "a member that knows the code" if cfg.join_code else "members to approve this node"
    _say(f"looking for {what} ({_where(cfg, found)})")
    shown: list[str] = []

    def on_code(code: str) -> None:
        shown[:] = [code]

    def on_pending(desks: list[DeskSeen]) -> None:
        # The code is on this screen only: typed on a member, it proves each side to the
        # other. The id lets the approver tell this node from a look-alike of its name.
        where = "; ".join(f"cluster {d.name!r} (id {d.cluster}) at {d.address}" for d in desks)
        _say(
            f"waiting for a member to approve: run `meshctl approve {shown[0]}` on a "
            f"member ({where}; this node: {cfg.name}, id {identity.node_id})"
        )

    # Bonjour may find the desk that knows the code after one that refuses; seeds are all
    # there from the start.
    refuse_after = cfg.settle_s if cfg.discovery else 0.0
    try:
        outcome = await ask_to_join(
            ctx, identity.key, cfg.name, candidates, code=cfg.join_code, on_code=on_code,
            on_pending=on_pending, search_s=JOIN_SEARCH_S, refuse_after_s=refuse_after,
        )  # fmt: skip
    except JoinRefusedError as e:
        raise RuntimeError(f"could not join: {e}") from None
    except NoClusterFoundError as e:
        raise RuntimeError(
            f"no cluster found: no join desk answered within {e.searched_s:.0f} s "
            f"({_where(cfg, found)}; asked: {', '.join(e.asked) or 'none'})"
        ) from None
    log.info("joined cluster %r (%s) through %s", outcome.cluster.name, outcome.cluster.id,
             outcome.via)  # fmt: skip
    return outcome.cluster


def _say(message: str) -> None:
    log.warning("%s", message)
    print(f"meshd: {message}", file=sys.stderr, flush=True)


def _where(cfg: NodeConfig, found: dict[str, PeerAddr]) -> str:
    """Where this node looks for members, for the messages that say so."""
    bonjour = f"Bonjour: {len(found)} meshd node(s) seen" if cfg.discovery else "Bonjour off"
    seeds = ", ".join(f"{h}:{join_port_of(p)}" for h, p in cfg.peers) or "none"
    return f"{bonjour}; seeds' join ports: {seeds}"


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

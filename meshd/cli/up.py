"""``meshd up``: the composition root that runs a node and its API until a stop.

Kept apart from the command line (``meshd.cli.meshd``) so that ``meshd config show``
and ``meshd --help`` do not import the node's whole stack.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

from meshd.api.app import create_app
from meshd.api.origins import allowed_hosts
from meshd.api.server import ApiServer, bind_api
from meshd.api.services import ApiSettings
from meshd.cli.keys import node_keys
from meshd.node.config import NodeConfig, parse_peer
from meshd.node.daemon import ApiAddress, Node
from meshd.node.dependencies import warn_untested
from meshd.node.local import move_old_cache
from meshd.node.owner import ensure_owner_token
from meshd.transport.addresses import local_addresses
from meshd.transport.security import load_secret

__all__ = ["node_config", "up"]


def node_config(args: argparse.Namespace) -> NodeConfig:
    """The node's configuration from ``meshd up``'s resolved flags (raises ValueError
    for flags that contradict each other)."""
    if args.open and (args.secret_file or args.join):
        raise ValueError("--open runs a cluster without keys: it takes no --secret-file or --join")
    if args.join and args.secret_file:
        raise ValueError("--join and --secret-file are two ways in: give one")
    api_key, admin_key = node_keys(args)
    if args.open and api_key:
        logging.getLogger("meshd").warning(
            "the API key guards the API, but --open leaves the mesh open: any machine on "
            "the LAN can join the cluster and read prompts as they pass through it"
        )
    cfg = NodeConfig(
        cluster=args.cluster,
        api_host=args.api_host,
        api_port=args.api_port,
        mesh_host=args.mesh_host,
        mesh_port=args.mesh_port,
        peers=[parse_peer(p) for p in args.peer],
        discovery=not args.no_discovery,
        advertise=args.advertise,
        model="" if args.no_model else args.model,
        model_dirs=list(args.models),
        max_memory=args.max_memory,
        context=args.context,
        slice_cache=args.slice_cache,
        secret=load_secret(args.secret_file),
        join_code=args.join,
        open=args.open,
        api_key=api_key,
        admin_key=admin_key,
        allow_hosts=args.allow_host,
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        forget_after=args.forget_after,
        replay_wait=args.replay_wait,
        max_clock_drift_ms=args.max_clock_drift,
        tombstone_grace_ms=args.tombstone_grace,
        load_wait=args.load_wait,
        keep_alive=args.keep_alive,
        models_rescan=args.models_rescan,
        chunk_timeout=args.chunk_timeout,
        request_expiry=args.request_expiry,
        stream_interval=args.stream_interval_ms / 1000,
        stop_grace=args.stop_grace,
        max_restarts=args.max_restarts,
        drain_timeout=args.drain_timeout,
    )
    if args.name:
        cfg.name = args.name
    if args.data_dir:
        cfg.data_dir = args.data_dir
    return cfg


async def up(cfg: NodeConfig) -> int:
    """Run a node and its API until a stop signal; the process exit code.

    The composition root: the node finds its cluster (a new one waits for approval),
    the API socket is bound (its port goes in the node's card), the node is built and
    started, the API serves the node's services; at the stop, the node drains, leaves,
    the API stops, the node closes.
    """
    warn_untested()
    move_old_cache(cfg.data_dir, cfg.cache_dir)
    host = cfg.api_listen_host()
    bound: list[socket.socket] = []

    def bind() -> ApiAddress:
        bound.append(bind_api(host, cfg.api_port))
        return ApiAddress(host, bound[0].getsockname()[1])

    try:
        node = await Node.start(cfg, bind)
    except BaseException:
        for s in bound:
            s.close()
        raise
    sock = bound[0]
    card = node.presence.card
    settings = ApiSettings(
        api_key=cfg.api_key,
        admin_key=cfg.admin_key,
        owner_token=ensure_owner_token(cfg.data_dir),  # the data dir is the node's now
        max_requests=cfg.max_requests,
        max_tokens=cfg.max_tokens,
        hosts=allowed_hosts(
            card.addresses, local_addresses(), [host, socket.gethostname()], allow=cfg.allow_hosts
        ),
    )
    app = create_app(node.services, settings)
    server = ApiServer(
        app, sock, stop_grace=cfg.api_stop_grace, retry_after=app.state.ctx.admission.retry_after
    )
    try:
        await server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, node.request_stop)
        # One machine-readable line on stdout: scripts and tests wait for it.
        print(
            f"meshd ready node={node.node_id} name={cfg.name} "
            f"api=http://{card.api_host}:{card.api_port} "
            f"mesh={card.mesh_port} pub={card.pub_port}",
            flush=True,
        )
        await node.wait()
        if not node.hurried:
            await node.drain()
    finally:
        await node.leave()
        await server.stop()
        await node.close()
    return node.exit_code

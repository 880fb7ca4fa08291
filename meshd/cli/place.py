"""``meshctl place``: place a model on the cluster, with the settings its requests get,
and print the plan (waiting, with each stage's progress, where asked)."""

from __future__ import annotations

import argparse
import sys
import time

from .argtypes import positive_float, positive_int
from .client import EXIT_NODE_ERROR, EXIT_OK, NodeClient

__all__ = ["add_place", "cmd_place"]


def cmd_place(args: argparse.Namespace, client: NodeClient) -> int:
    """Place a model on the cluster and print the plan."""
    from .instances import print_instances, wait_serving

    body: dict = {"model": args.model}
    if args.nodes and args.nodes.strip().isdigit():
        # `--nodes 2` reads as "over two nodes" (a count); names are comma-separated.
        # A node whose name is all digits can still be named by its id.
        body["min_nodes"] = int(args.nodes)
    elif args.nodes:
        body["nodes"] = [n.strip() for n in args.nodes.split(",") if n.strip()]
    if args.engines:
        body["engines"] = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.min_nodes:
        body["min_nodes"] = args.min_nodes
    if args.ctx:
        body["context"] = args.ctx
    if args.replicas:
        body["replicas"] = args.replicas
    if args.keep:
        body["keep"] = True
    if args.kv_cache:
        body["kv_cache"] = args.kv_cache
    if args.draft:
        body["draft"] = args.draft
    if args.speculate:
        body["speculate"] = {"auto": None, "on": True, "off": False}[args.speculate]
    if args.exact:
        body["exact"] = True
    if args.exclude:
        body["exclude"] = [n.strip() for x in args.exclude for n in x.split(",") if n.strip()]
    placed = client.place(body)
    insts = placed["data"] if placed.get("object") == "list" else [placed]
    wait = sys.stdout.isatty() if args.wait is None else args.wait
    if wait:
        deadline = time.monotonic() + args.wait_timeout
        insts = [wait_serving(client, i, max(0.0, deadline - time.monotonic())) for i in insts]
    print_instances(insts, client)
    stages = [s for i in insts for s in i.get("stages") or []]
    if wait and not all(s.get("state") == "ready" for s in stages):
        return EXIT_NODE_ERROR
    return EXIT_OK


def add_place(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``meshctl place`` to ``sub``."""
    p = sub.add_parser(
        "place", parents=[common],
        help="Place a model (split across nodes): it replaces the instance a request "
        "placed on its own (--keep keeps it).",
    )  # fmt: skip
    p.add_argument("model", help="alias (smollm2-135m), path to a .gguf, or HF repo id")
    p.add_argument(
        "--nodes",
        metavar="N|NAMES",
        help="a count (split over at least N nodes) or comma-separated node names or ids, "
        "in stage order",
    )
    p.add_argument("--engines", help="comma-separated engine per stage (llama_cpp, mlx)")
    p.add_argument("--min-nodes", type=int, help="split over at least this many nodes")
    p.add_argument(
        "--ctx",
        type=positive_int,
        metavar="TOKENS",
        help="context of each request, prompt and answer (default: 4096, at most the "
        "model's trained context); every stage reserves KV cache for it",
    )
    p.add_argument(
        "--kv-cache", choices=["f16", "q8_0", "q4_0"],
        help="KV cache type of the llama.cpp stages: q8_0 or q4_0 keep about 0.53x or "
        "0.28x the bytes of f16 (a longer context in the same memory)",
    )  # fmt: skip
    p.add_argument(
        "--draft", metavar="MODEL",
        help="the placed model that drafts tokens for this one to verify (speculative "
        "decoding; default: any placed model with the same tokens and at most half the "
        "size, nearest first; a named one may be any size); 'none' for none",
    )  # fmt: skip
    p.add_argument(
        "--speculate", choices=["auto", "on", "off"],
        help="speculative decoding for requests that do not say: auto (default) drafts "
        "for every request on a split, on for every request (one node too), off for "
        "none (a request's own 'speculate' still decides for it)",
    )  # fmt: skip
    p.add_argument(
        "--exact", action="store_true",
        help="the exact mode for requests that do not say 'exact': no prefix reuse, no "
        "speculation, so the same request answers bit for bit the same whatever ran "
        "before (slower: every turn computes its whole prompt)",
    )  # fmt: skip
    p.add_argument(
        "--exclude", action="append", metavar="NODE",
        help="never run this model on NODE (a name or id; repeat or comma-separate for "
        "more): placement leaves it out on every node, repairs included",
    )  # fmt: skip
    p.add_argument(
        "--replicas", type=positive_int, metavar="N",
        help="place N instances of the model, each on nodes of its own (more than the "
        "nodes can hold is refused, nothing placed); requests go to the least busy one",
    )  # fmt: skip
    p.add_argument(
        "--keep", action="store_true",
        help="keep the model's automatic instance (the one a request placed) beside this "
        "one; without it, this placement replaces it: the model moves",
    )  # fmt: skip
    p.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wait until every stage serves, with each stage's progress (fetching its "
        "weights from a peer, loading) (default: at a terminal)",
    )
    p.add_argument(
        "--wait-timeout", type=positive_float, default=900.0, metavar="S",
        help="with --wait: give up after this many seconds (default: 900)",
    )  # fmt: skip
    p.set_defaults(func=cmd_place)

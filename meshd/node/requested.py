"""What a placement a user asks for (``POST /v1/instances``) is checked against, and
the words of its refusals: a model MLX cannot run, node names that name no node or
several, and replicas that do not fit apart (``meshd.node.instances`` places them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from meshd.crdt.views import Instance
from meshd.models import ResolvedModel
from meshd.models.folder import check_folder_for_mlx
from meshd.models.mlx_layout import check_gguf_for_mlx
from meshd.placement import PlacementError

from .cluster import ClusterView

__all__ = ["check_mlx", "node_ids", "too_many_replicas"]


def check_mlx(resolve: Callable[[str], ResolvedModel], model: str, pinned: bool) -> None:
    """Raise UnsupportedModelError when MLX must run ``model`` (pinned, or a folder)
    and cannot, with the stage's own reason. A model not on this machine is not checked
    here."""
    try:
        resolved = resolve(model)
    except LookupError:
        return  # not on this machine: facts() says where it looked, or finds it
    if resolved.format == "gguf" and not pinned:
        # Its facts offer MLX only where this same check passes (models.facts), and
        # placement never picks an engine the facts or the architecture rule leave out.
        return
    check = check_gguf_for_mlx if resolved.format == "gguf" else check_folder_for_mlx
    check(resolved.path)


def node_ids(view: ClusterView, refs: Sequence[str]) -> list[str]:
    """Node names or ids as ids, sorted (an exclusion names the machine, whatever name
    it gives itself later); PlacementError for a name no node or several have."""
    out = set()
    for ref in refs:
        named = sorted(nid for nid, c in view.cards.items() if c.name == ref)
        if ref in view.cards or ref in view.members:
            out.add(ref)
        elif len(named) == 1:
            out.add(named[0])
        elif named:
            why = f"node name {ref!r} is ambiguous: ids {', '.join(named)}"
            raise PlacementError("bad_spec", why)
        else:
            raise PlacementError("unknown_node", f"exclude names node {ref!r}: no node has it")
    return sorted(out)


def too_many_replicas(
    model: str, asked: int, fit: list[Instance], view: ClusterView, why: PlacementError
) -> PlacementError:
    """The error of ``asked`` replicas of which only ``fit`` could be placed apart."""
    cards = view.cards
    nodes = sorted(
        {cards[s.node].name if s.node in cards else s.node for p in fit for s in p.stages}
    )
    return PlacementError(
        "too_many_replicas",
        f"only {len(fit)} of the {asked} replicas of {model} fit: replicas go on "
        f"different nodes, and those that can hold it ({', '.join(nodes)}) hold "
        f"{len(fit)} (the next one: {why}); ask for --replicas {len(fit)}, or add a node",
    )

"""What a node says of each model the cluster can serve: who holds it and which
instances serve it (the ``models`` of each ``GET /v1/cluster/stream`` snapshot).

Names are matched as the node matches them (``canonical_name``: an alias's one
spelling), over the nodes it counts as live (``ClusterView.is_live``), and each
instance's state is the instance view's (``instance_view.py``): the page shows the
node's answer, not a rule of its own.
"""

from __future__ import annotations

import msgspec

from meshd.models import canonical_name
from meshd.node.cluster import ClusterView

from .instance_view import InstanceView

__all__ = ["ModelView", "ServingInstance", "model_views"]


class ServingInstance(msgspec.Struct, kw_only=True):
    """An instance of a model, and its state in one word (``InstanceView.state``)."""

    id: str
    state: str


class ModelView(msgspec.Struct, kw_only=True):
    """One model: the live nodes that hold it on disk, the instances that serve it."""

    model: str
    #: Weight bytes, from the facts a holder or an instance gives (null: not read yet).
    size: int | None
    #: Names and ids of the live nodes whose card lists it, in name order.
    nodes: list[str]
    node_ids: list[str]
    instances: list[ServingInstance]


def model_views(view: ClusterView, instances: list[InstanceView]) -> list[ModelView]:
    """Every model a live node holds or an instance serves, by name."""
    rows: dict[str, ModelView] = {}

    def row(name: str) -> ModelView:
        canon = canonical_name(name)
        if canon not in rows:
            rows[canon] = ModelView(model=canon, size=None, nodes=[], node_ids=[], instances=[])
        return rows[canon]

    for nid, card in sorted(view.cards.items(), key=lambda kv: (kv[1].name, kv[0])):
        if not view.is_live(nid):
            continue
        for name in card.models:
            r = row(name)
            r.nodes.append(card.name)
            r.node_ids.append(nid)
        for f in card.model_facts:
            held = rows.get(canonical_name(f.name))
            if held is not None and held.size is None:
                held.size = sum(f.layer_bytes) + f.embed_bytes + f.head_bytes
    for iv in instances:
        row(iv.model).instances.append(ServingInstance(id=iv.id, state=iv.state))
    return [rows[k] for k in sorted(rows)]

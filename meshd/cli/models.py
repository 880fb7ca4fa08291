"""``meshctl models``: which node holds which model, read from ``GET /v1/cluster``.

Pure functions of the cluster document (the same one ``meshctl top`` reads): the
rows, and the table drawn from them; ``--json`` prints the rows themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.markup import escape
from rich.table import Table

from meshd.models import canonical_name

from .top import _dict, _list, _names, _num

__all__ = ["model_rows", "models_table"]

#: Nodes that no longer count: their models are not the cluster's any more.
_GONE = ("dead", "left")


def model_rows(cluster: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per model a live node holds or an instance serves, sorted by name.

    Each row: ``model``, ``format``, ``size`` (weight bytes), ``active`` (the bytes of
    them a decoded token reads: less than ``size`` for a mixture of experts) and
    ``sha256`` from the facts a holder advertises (None until it has read them),
    ``nodes`` (the names of the nodes that hold it) and ``node_ids``, ``instances``
    (ids of the instances serving it) and ``serving``: ``ready`` when one instance has
    every stage ready, ``loading`` when one is placed, ``""`` when none is.
    """
    names = _names(cluster)
    rows: dict[str, dict[str, Any]] = {}

    def row(model: str) -> dict[str, Any]:
        canon = canonical_name(model)
        return rows.setdefault(
            canon,
            {"model": canon, "format": None, "size": None, "active": None, "sha256": None,
             "nodes": [],
             "node_ids": [], "instances": [], "serving": ""},
        )  # fmt: skip

    nodes = {str(_dict(n).get("id")): _dict(n) for n in _list(cluster.get("nodes"))}
    for nid, node in sorted(nodes.items(), key=lambda kv: names.get(kv[0], kv[0])):
        if node.get("liveness") in _GONE:
            continue
        card = _dict(node.get("card"))
        for model in _list(card.get("models")):
            r = row(str(model))
            r["nodes"].append(names.get(nid, nid))
            r["node_ids"].append(nid)
        for facts in map(_dict, _list(card.get("model_facts"))):
            canon = canonical_name(str(facts.get("name", "")))
            if canon in rows and rows[canon]["sha256"] is None:
                rows[canon].update(
                    format=facts.get("format", "gguf"),
                    size=_weight_bytes(facts),
                    active=_weight_bytes(facts, active=True),
                    sha256=facts.get("sha256"),
                )
    for inst in map(_dict, _list(cluster.get("instances"))):
        r = row(str(_dict(inst.get("spec")).get("model", "")))
        r["instances"].append(inst.get("id"))
        ready = _ready(inst, nodes)
        r["serving"] = "ready" if ready or r["serving"] == "ready" else "loading"
        if r["sha256"] is None and inst.get("facts"):
            facts = _dict(inst.get("facts"))
            r.update(
                format=facts.get("format", "gguf"),
                size=_weight_bytes(facts),
                active=_weight_bytes(facts, active=True),
                sha256=facts.get("sha256"),
            )
    return [rows[k] for k in sorted(rows)]


def _weight_bytes(facts: Mapping[str, Any], active: bool = False) -> int:
    """Bytes of the model's weights: its layers, embedding and head; ``active``: of
    the layers, what a decoded token reads (``layer_active_bytes``, where given)."""
    layers = _list(facts.get("layer_bytes"))
    if active and len(_list(facts.get("layer_active_bytes"))) == len(layers):
        layers = _list(facts.get("layer_active_bytes"))
    parts = [*layers, facts.get("embed_bytes"), facts.get("head_bytes")]
    return sum(int(_num(b) or 0) for b in parts)


def _ready(inst: Mapping[str, Any], nodes: Mapping[str, Mapping[str, Any]]) -> bool:
    """Every stage's node reports a ready runner at the instance's generation."""
    generation = inst.get("generation", 1)
    stages = [_dict(s) for s in _list(inst.get("stages"))]
    if not stages:
        return False
    for i, stage in enumerate(stages):
        node = nodes.get(str(stage.get("node")), {})
        runners = map(_dict, _list(_dict(node.get("health")).get("runners")))
        if not any(
            r.get("instance") == inst.get("id")
            and r.get("stage", 0) == i
            and r.get("generation") == generation
            and r.get("state") == "ready"
            for r in runners
        ):
            return False
    return True


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def models_table(rows: list[dict[str, Any]]) -> Table:
    """The rows of :func:`model_rows` as a table: model, format, size (and the active
    bytes of a mixture of experts), holders, serving."""
    t = Table(box=None, header_style="bold")
    for col in ("model", "format", "size", "nodes", "serving"):
        t.add_column(col, justify="right" if col == "size" else "left")
    style = {"ready": "green", "loading": "yellow"}
    for r in rows:
        serving = r["serving"] or "-"
        if r["instances"]:
            serving += f" ({', '.join(map(str, r['instances']))})"
        # Names a member wrote are text, never markup (``[link=...]`` in a model name).
        serving = escape(serving)
        t.add_row(
            escape(r["model"]),
            escape(r["format"] or "?"),
            _size(r["size"])
            + (
                f" ({_size(r['active'])} active)"
                if r.get("active") not in (None, r["size"])
                else ""
            ),
            escape(", ".join(r["nodes"]) or "-"),
            f"[{style[r['serving']]}]{serving}[/]" if r["serving"] in style else serving,
        )
    return t

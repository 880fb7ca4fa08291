"""``meshctl top``: a live view of the cluster as one node sees it.

``render`` is pure: it turns the JSON of ``GET /v1/cluster`` (and the nodes waiting for
approval, from ``GET /v1/members``) into a rich renderable and reads no clock and no
network, so it can be tested with literal dicts. ``run_top`` fetches and draws, once or
in a ``rich.live.Live`` loop; on a terminal, the keys 1-9 approve the waiting node of
that number and q quits.

Fields a node omits (msgspec ``omit_defaults``) or a ``null`` health are shown as ``-``;
a malformed field never raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich import box
from rich.cells import cell_len
from rich.console import (
    Console,
    ConsoleOptions,
    Group,
    JustifyMethod,
    RenderableType,
    RenderResult,
)
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .client import MeshctlError

if TYPE_CHECKING:
    from .client import NodeClient

LIVENESS_STYLE = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}
RUNNER_STYLE = {
    "ready": "green", "fetching": "cyan", "loading": "yellow", "failed": "red", "stopped": "dim",
}  # fmt: skip
GIB = 1024**3
BAR_WIDTH = 10
_EIGHTHS = " ▏▎▍▌▋▊▉"
#: Width of a frame printed to something that is not a terminal.
PLAIN_WIDTH = 120


# ---------------------------------------------------------------- small readers


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def short_id(node_id: str, n: int = 8) -> str:
    """The first ``n`` characters of an id, enough to tell nodes apart on screen."""
    return node_id[:n]


def _names(cluster: Mapping[str, Any]) -> dict[str, str]:
    """Display name by node id."""
    out = {}
    for node in _list(cluster.get("nodes")):
        node = _dict(node)
        nid = str(node.get("id") or "")
        name = node.get("name") or _dict(node.get("card")).get("name")
        if nid:
            out[nid] = str(name) if name else short_id(nid)
    return out


# ---------------------------------------------------------------- speed


def _weighted(pairs: list[tuple[float, float]]) -> float | None:
    """The mean of ``(value, weight)`` pairs weighted by the weight (plain mean when
    every weight is 0); None for no pairs with a value."""
    pairs = [(v, w) for v, w in pairs if v]
    if not pairs:
        return None
    total = sum(w for _, w in pairs)
    if total <= 0:
        return sum(v for v, _ in pairs) / len(pairs)
    return sum(v * w for v, w in pairs) / total


def node_speed(node: Mapping[str, Any]) -> dict[str, float]:
    """A node's ``tokens_s`` (what its API streams now) and ``in_flight`` requests."""
    health = _dict(node.get("health"))
    serving = [_dict(v) for v in _dict(health.get("serving")).values()]
    tps = _num(health.get("tokens_s")) or 0.0
    return {"tokens_s": tps, "in_flight": sum(_num(v.get("in_flight")) or 0 for v in serving)}


def instance_speed(cluster: Mapping[str, Any], inst: Mapping[str, Any]) -> dict[str, Any]:
    """One instance's figures over the last minute, added up over every node that sent
    it requests: tokens/s and requests in flight (sums), queue depth (requests holding
    KV on stage 0), time to first token, between tokens, per stage and per hop (medians
    each node measured, weighted by its tokens/s). Pure: reads the cluster JSON only."""
    model = str(_dict(inst.get("spec")).get("model") or "")
    iid = str(inst.get("id") or "")
    per_node = []
    queue = 0
    stages = [_dict(s) for s in _list(inst.get("stages"))]
    first = str(stages[0].get("node")) if stages else ""
    for node in map(_dict, _list(cluster.get("nodes"))):
        health = _dict(node.get("health"))
        m = _dict(_dict(health.get("serving")).get(model))
        if m:
            per_node.append(m)
        if str(node.get("id")) == first:
            queue = sum(
                int(_num(r.get("active")) or 0)
                for r in map(_dict, _list(health.get("runners")))
                if r.get("instance") == iid and r.get("stage", 0) == 0
            )

    def med(key: str) -> float | None:
        return _weighted([(_num(m.get(key)) or 0.0, _num(m.get("tokens_s")) or 0.0)
                          for m in per_node])  # fmt: skip

    stage_ms = []
    for i in range(len(stages)):
        stage_ms.append(_weighted([
            (float(_list(m.get("stage_ms"))[i]), _num(m.get("tokens_s")) or 0.0)
            for m in per_node
            if len(_list(m.get("stage_ms"))) > i and _num(_list(m.get("stage_ms"))[i])
        ]))  # fmt: skip
    return {
        "tokens_s": round(sum(_num(m.get("tokens_s")) or 0.0 for m in per_node), 2),
        "in_flight": int(sum(_num(m.get("in_flight")) or 0 for m in per_node)),
        "queue": queue,
        "ttft_ms": med("ttft_ms"),
        "itl_ms": med("itl_ms"),
        "hop_ms": med("hop_ms"),
        "stage_ms": stage_ms,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"


def snapshot(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """What ``top`` shows, for machines (``meshctl top --json``): every node's liveness
    and speed, every instance's speed and stages."""
    names = _names(cluster)
    nodes = []
    for node in _sorted_nodes(cluster):
        health = _dict(node.get("health"))
        nodes.append({
            "id": node.get("id"), "name": names.get(str(node.get("id"))),
            "liveness": node.get("liveness"), "state": health.get("state"),
            "mem_available": health.get("mem_available"), "load": health.get("load"),
            "decode_bps": health.get("decode_bps", 0.0), "rtt_ms": health.get("rtt_ms", {}),
            **node_speed(node),
        })  # fmt: skip
    instances = []
    for inst in sorted(map(_dict, _list(cluster.get("instances"))), key=lambda i: str(i.get("id"))):
        speed = instance_speed(cluster, inst)
        stage_ms = speed.pop("stage_ms")
        stages = [
            {"node": st.get("node"), "name": names.get(str(st.get("node"))),
             "start": st.get("start"), "end": st.get("end"), "engine": st.get("engine"),
             "ms_per_token": stage_ms[i] if i < len(stage_ms) else None}
            for i, st in enumerate(map(_dict, _list(inst.get("stages"))))
        ]  # fmt: skip
        instances.append({
            "id": inst.get("id"), "model": _dict(inst.get("spec")).get("model"),
            "generation": inst.get("generation"), **speed, "stages": stages,
            "predicted_tokens_s": _predicted(cluster, inst),
        })  # fmt: skip
    return {"cluster": cluster.get("cluster"), "self": cluster.get("self"), "nodes": nodes,
            "instances": instances}  # fmt: skip


# ---------------------------------------------------------------- cell formatters


def _liveness(state: Any) -> Text:
    word = str(state) if state else "unknown"
    return Text(word, style=LIVENESS_STYLE.get(word, ""))


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def mem_figures(used: float | None, total: float | None) -> Text:
    """``5.2/16.0 GiB``: memory in use out of total, ``-`` when unknown."""
    if used is None or not total or total <= 0:
        return Text("-", style="dim")
    return Text(f"{_gib(max(used, 0))}/{_gib(total)} GiB")


def mem_bar(used: float | None, total: float | None, width: int = BAR_WIDTH) -> Text:
    """``███▌░░░░░░``: the share of memory in use, in eighths of a block; empty if unknown."""
    if used is None or not total or total <= 0:
        return Text("")
    frac = min(max(used / total, 0.0), 1.0)
    full, part = divmod(round(frac * width * 8), 8)
    filled = "█" * full + (_EIGHTHS[part] if part else "")
    text = Text()
    text.append(filled, style="green" if frac < 0.7 else "yellow" if frac < 0.9 else "red")
    text.append("░" * (width - len(filled)), style="dim")
    return text


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def _runner_state(state: Any, generation: Any = None) -> Text:
    word = str(state) if state else "?"
    text = Text(word, style=RUNNER_STYLE.get(word, ""))
    if generation is not None:
        text.append(f" g{generation}", style="dim")
    return text


def _lines(parts: Iterable[Text]) -> Text:
    parts = list(parts)
    return Text("\n").join(parts) if parts else Text("-", style="dim")


def _predicted(cluster: Mapping[str, Any], inst: Mapping[str, Any]) -> float:
    """Placement's predicted tokens/s of one request of ``inst`` (0.0: not known)."""
    return _num(_dict(cluster.get("predicted_tokens_s")).get(str(inst.get("id")))) or 0.0


def _stream(pred: float, speed: Mapping[str, Any]) -> str:
    """One request's tokens/s: placement's prediction, and what was measured (1000 /
    the time between tokens): ``41/38``, ``-`` for a figure not known yet."""
    itl = _num(speed.get("itl_ms")) or 0.0
    real = 1000 / itl if itl > 0 else 0.0
    return f"{f'{pred:.0f}' if pred else '-'}/{f'{real:.0f}' if real else '-'}"


def _gpu(d: Any) -> str:
    """A GPU of a card, as ``CUDA0 23/24G`` (free of total, as probed)."""
    if not isinstance(d, dict):
        return "?"
    free, total = _num(d.get("mem_free")) or 0, _num(d.get("mem_total")) or 0
    shared = " shared" if d.get("unified") else ""
    return f"{d.get('name', '?')} {free / 2**30:.0f}/{total / 2**30:.0f}G{shared}"


def _each(values: Any) -> Text:
    return _lines(Text(str(v)) for v in _list(values))


# ---------------------------------------------------------------- tables that fit


@dataclass
class Column:
    """A column of a FitTable. ``priority`` 0 is always shown; higher goes first."""

    header: str
    priority: int = 0
    justify: JustifyMethod = "left"
    style: str = ""
    no_wrap: bool = True


def _width(cell: Text) -> int:
    return max((cell_len(line) for line in cell.plain.split("\n")), default=0)


class FitTable:
    """A table that drops its least important columns to fit the width it is drawn at.

    Rich squeezes a too-wide table by truncating every column; for a status view it is
    better to lose the uptime than to lose half of every name.
    """

    #: Padding and separator around each column of a SIMPLE_HEAD table.
    GAP = 3

    def __init__(
        self,
        title: str,
        columns: list[Column],
        rows: list[list[Text]],
        caption: str | None = None,
    ) -> None:
        self.title = title
        self.columns = columns
        self.rows = rows
        self.caption = caption

    def shown(self, width: int | None) -> list[int]:
        """Indexes of the columns that fit in ``width`` (all of them when None)."""
        if width is None:
            return list(range(len(self.columns)))
        natural = [
            max([cell_len(col.header)] + [_width(row[i]) for row in self.rows])
            for i, col in enumerate(self.columns)
        ]
        keep, used, cutoff = set(), 0, None
        for i in sorted(range(len(self.columns)), key=lambda i: (self.columns[i].priority, i)):
            priority, need = self.columns[i].priority, natural[i] + self.GAP
            if cutoff is not None and priority > cutoff:
                break  # a less important column never displaces a more important one
            if priority == 0 or used + need <= width:
                keep.add(i)
                used += need
            else:
                cutoff = priority
        return sorted(keep)

    def table(self, width: int | None = None) -> Table:
        """A rich Table of the columns that fit in ``width``."""
        table = Table(
            title=self.title,
            title_justify="left",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            caption=self.caption,
            caption_justify="left",
        )
        shown = self.shown(width)
        for i in shown:
            col = self.columns[i]
            table.add_column(col.header, justify=col.justify, style=col.style, no_wrap=col.no_wrap)
        for row in self.rows:
            table.add_row(*(row[i] for i in shown))
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)


# ---------------------------------------------------------------- the views


def _sorted_nodes(cluster: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    nodes = [_dict(n) for n in _list(cluster.get("nodes"))]
    return sorted(nodes, key=lambda n: (str(n.get("name") or ""), str(n.get("id") or "")))


def nodes_table(
    cluster: Mapping[str, Any], now_ms: int | None = None, detail: bool = False
) -> FitTable:
    """One row per node: liveness, memory, backends, uptime, heartbeat age, load, runners.

    ``detail`` (``meshctl nodes``) adds platform, CPUs, API address, version, local
    models, queue depth and tokens/s, and leaves the runners to ``top``. Columns are
    dropped, least useful first, when the console is too narrow.
    """
    cols: dict[str, Column] = {
        "name": Column("name", 0, style="bold"),
        "id": Column("id", 2, style="dim"),
        "liveness": Column("liveness", 0),
        "memory": Column("memory", 0, justify="right"),
        "bar": Column("", 5 if detail else 3),
        "backends": Column("backends", 2),
    }
    if detail:
        cols |= {
            "platform": Column("platform", 3),
            "cpus": Column("cpus", 4, justify="right"),
            "api": Column("api", 2),
            "version": Column("version", 3),
            "models": Column("models", 2),
        }
    cols |= {
        "up": Column("up", 5 if detail else 4, justify="right"),
        "heartbeat": Column("heartbeat", 4 if detail else 1, justify="right"),
        "load": Column("load", 5 if detail else 1, justify="right"),
    }
    cols |= {
        "tok/s": Column("tok/s", 6 if detail else 0, justify="right"),
        "reqs": Column("reqs", 6 if detail else 2, justify="right"),
    }
    if detail:
        cols["queue"] = Column("queue", 6, justify="right")
    else:
        cols["runners"] = Column("runners", 0, no_wrap=False)

    rows = []
    for node in _sorted_nodes(cluster):
        nid = str(node.get("id") or "")
        card = _dict(node.get("card"))
        health = _dict(node.get("health"))
        total = _num(card.get("mem_total"))
        avail = _num(health.get("mem_available")) or _num(card.get("mem_available"))
        used = total - avail if total is not None and avail is not None else None
        started = _num(card.get("started_ms"))
        up = (now_ms - started) / 1000 if now_ms is not None and started else None
        load = _num(health.get("load"))
        speed = node_speed(node)
        cell = {
            "name": Text(str(node.get("name") or card.get("name") or short_id(nid) or "?")),
            "id": Text(short_id(nid)),
            "liveness": _liveness(node.get("liveness")),
            "memory": mem_figures(used, total),
            "bar": mem_bar(used, total),
            "backends": _each(
                [*_list(card.get("backends")), *(_gpu(d) for d in _list(card.get("devices")))]
            ),
            "up": Text(_age(up) if up is not None and up >= 0 else "-"),
            "heartbeat": Text(_age(_num(node.get("heartbeat_age_s")))),
            "load": Text(f"{load:.2f}" if load is not None else "-"),
            "tok/s": Text(f"{speed['tokens_s']:.1f}" if health else "-"),
            "reqs": Text(f"{speed['in_flight']:.0f}" if health else "-"),
            "runners": _lines(
                Text.assemble(f"{r.get('instance', '?')} ", _runner_state(r.get("state")))
                for r in map(_dict, _list(health.get("runners")))
            ),
        }
        if detail:
            cpus = _num(card.get("cpu_count"))
            api_host = card.get("api_host") or next(iter(_list(card.get("addresses"))), "")
            api_port = card.get("api_port")
            queue = _num(health.get("queue_depth"))
            cell |= {
                "platform": Text("/".join(str(card[k]) for k in ("os", "arch") if card.get(k))),
                "cpus": Text(str(cpus) if cpus is not None else "-"),
                "api": Text(f"{api_host}:{api_port}" if api_host and api_port else "-"),
                "version": Text(str(card.get("version") or "-")),
                "models": _each(card.get("models")),
                # omitted by the node when zero; unknown only without a heartbeat
                "queue": Text(str(queue if queue is not None else 0) if health else "-"),
            }
        rows.append([cell[k] for k in cols])
    return FitTable("nodes", list(cols.values()), rows)


def _fetch_note(r: Mapping[str, Any]) -> str:
    """``37% of 49 MB, 20.5 MB/s``: how far a stage's weights fetch is."""
    done, total = _num(r.get("fetched")) or 0, _num(r.get("fetch_total")) or 0
    rate = _num(r.get("fetch_rate")) or 0.0
    if not total:
        return "(asking holders)"
    return f"{100 * done / total:.0f}% of {total / 1e6:.0f} MB, {rate / 1e6:.1f} MB/s"


def _stage_state(node: Mapping[str, Any] | None, instance_id: str, generation: Any) -> Text:
    """State of the runner that a stage's node reports for this instance's generation."""
    if node is None:
        return Text("unknown node", style="red")
    health = _dict(node.get("health"))
    runners = [_dict(r) for r in _list(health.get("runners"))]
    mine = [r for r in runners if r.get("instance") == instance_id]
    current = [r for r in mine if r.get("generation") == generation]
    if current:
        r = current[0]
        text = _runner_state(r.get("state"))
        if r.get("state") == "fetching":
            text.append(f" {_fetch_note(r)}", style="cyan")
        if r.get("reason"):
            text.append(f" ({r['reason']})", style="dim")
    elif mine:  # the node still runs another generation of the plan
        r = max(mine, key=lambda r: _num(r.get("generation")) or 0)
        text = _runner_state(r.get("state"), r.get("generation"))
        text.append(" stale", style="dim")
    else:
        text = Text("pending", style="dim")
    liveness = node.get("liveness")
    if liveness and liveness != "alive":
        text.append(f" (node {liveness})", style=LIVENESS_STYLE.get(str(liveness), ""))
    return text


#: Reasons a node gives for a runner it will not restart (``meshd.node.supervisor``):
#: placement leaves such a node out of the instance, and top says why.
GIVEN_UP = ("crash loop", "model not available here")


def excluded_nodes(cluster: Mapping[str, Any], instance_id: str) -> list[tuple[str, str]]:
    """``(node id, reason)`` of every node that gave up a runner of this instance.

    Read from the nodes' heartbeats, which keep a given-up runner after its stage
    moved away, so the reason stays visible after the repair.
    """
    out = []
    for node in map(_dict, _list(cluster.get("nodes"))):
        for r in map(_dict, _list(_dict(node.get("health")).get("runners"))):
            reason = str(r.get("reason") or "")
            if (
                r.get("instance") == instance_id
                and r.get("state") == "failed"
                and reason.startswith(GIVEN_UP)
            ):
                out.append((str(node.get("id") or "?"), reason))
                break
    return out


def instances_table(cluster: Mapping[str, Any]) -> FitTable:
    """One row per placed instance: its speed over the last minute (tokens/s, requests
    in flight, queue, median time to first token and between tokens), one line per
    stage (``node[start:end) engine state`` and its ms per token) and the per-hop ms."""
    names = _names(cluster)
    by_id = {str(_dict(n).get("id")): _dict(n) for n in _list(cluster.get("nodes"))}
    instances = sorted(
        (_dict(i) for i in _list(cluster.get("instances"))), key=lambda i: str(i.get("id"))
    )
    columns = [
        Column("id", 0, style="bold"),
        Column("model", 0, no_wrap=False),
        Column("gen", 3, justify="right"),
        Column("tok/s", 0, justify="right"),
        Column("reqs", 2, justify="right"),
        Column("queue", 4, justify="right"),
        Column("ttft", 2, justify="right"),
        Column("itl", 2, justify="right"),
        Column("1 req pred/real", 3, justify="right"),
        Column("stages (ms/token)", 0, no_wrap=False),
    ]
    rows = []
    for inst in instances:
        iid = str(inst.get("id") or "?")
        generation = inst.get("generation", 1)
        speed = instance_speed(cluster, inst)
        stages = []
        for i, st in enumerate(map(_dict, _list(inst.get("stages")))):
            nid = str(st.get("node") or "?")
            line = Text(names.get(nid) or short_id(nid))
            line.append(f"[{st.get('start', '?')}:{st.get('end', '?')})")
            if st.get("engine"):
                line.append(f" {st['engine']}", style="cyan")
            line.append(" ")
            line.append_text(_stage_state(by_id.get(nid), iid, generation))
            ms = speed["stage_ms"][i] if i < len(speed["stage_ms"]) else None
            if ms is not None:
                line.append(f" {_ms(ms)}", style="magenta")
            stages.append(line)
        if speed["hop_ms"] is not None:
            stages.append(Text(f"hop {_ms(speed['hop_ms'])}", style="dim magenta"))
        for nid, reason in excluded_nodes(cluster, iid):
            line = Text("excluded ", style="red")
            line.append(names.get(nid) or short_id(nid), style="bold")
            line.append(f" ({reason})", style="dim")
            stages.append(line)
        model = str(_dict(inst.get("spec")).get("model") or "?")
        rows.append([
            Text(iid), Text(model), Text(str(generation)),
            Text(f"{speed['tokens_s']:.1f}"), Text(str(speed["in_flight"])),
            Text(str(speed["queue"])), Text(_ms(speed["ttft_ms"])),
            Text(_ms(speed["itl_ms"])), Text(_stream(_predicted(cluster, inst), speed)),
            _lines(stages),
        ])  # fmt: skip
    return FitTable(
        "instances", columns, rows, caption=None if instances else "no instances placed"
    )


def header(cluster: Mapping[str, Any]) -> Text:
    """``cluster home · 2/3 nodes alive · 1 instance · via mini (1a2b3c4d)``."""
    nodes = [_dict(n) for n in _list(cluster.get("nodes"))]
    alive = sum(1 for n in nodes if n.get("liveness") == "alive")
    n_inst = len(_list(cluster.get("instances")))
    me = str(cluster.get("self") or "")
    me_name = _names(cluster).get(me)

    text = Text("cluster ", style="bold")
    text.append(str(cluster.get("cluster") or "?"), style="bold cyan")
    text.append(" · ")
    text.append(f"{alive}/{len(nodes)}", style="green" if alive == len(nodes) else "yellow")
    text.append(" nodes alive · ")
    text.append(f"{n_inst} instance{'' if n_inst == 1 else 's'}")
    if me:
        text.append(" · via ")
        text.append(me_name or short_id(me), style="bold")
        if me_name and me_name != short_id(me):
            text.append(f" ({short_id(me)})", style="dim")
    return text


def pending_table(pending: list[Mapping[str, Any]]) -> Table:
    """The nodes waiting for approval at this node, numbered for the approve keys."""
    table = Table(
        title="waiting to join (press the number to approve)",
        title_justify="left",
        title_style="bold yellow",
        box=box.SIMPLE_HEAD,
    )
    for col in ("#", "name", "id", "waiting"):
        table.add_column(col)
    for i, p in enumerate(pending[:9], 1):
        table.add_row(
            Text(str(i), style="bold"),
            Text(str(p.get("name") or "?")),
            Text(str(p.get("id") or "?"), style="dim"),
            Text(_age(_num(p.get("waiting_s")))),
        )
    return table


def render(
    cluster: Mapping[str, Any],
    now_ms: int | None = None,
    pending: list[Mapping[str, Any]] | None = None,
) -> RenderableType:
    """The whole ``top`` frame for one ``GET /v1/cluster`` answer, and the nodes waiting
    for approval (the ``pending`` list of ``GET /v1/members``) when there are any.

    Pure: ``now_ms`` (wall clock, ms) is only used for node uptimes, shown as ``-`` when
    it is None.
    """
    parts: list[RenderableType] = [
        header(cluster), Text(), nodes_table(cluster, now_ms), Text(), instances_table(cluster)
    ]  # fmt: skip
    if pending:
        parts += [Text(), pending_table(pending)]
    return Group(*parts)


# ---------------------------------------------------------------- the loop


def stdout_console() -> Console:
    """A Console on stdout: the terminal's width, or 120 plain columns when piped
    (``$COLUMNS`` still wins)."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=PLAIN_WIDTH)
    return console


def error_panel(error: Exception, base_url: str, last_ok: float | None, now: float) -> Panel:
    """What ``top`` shows instead of a traceback while the node cannot be reached."""
    body = Text(str(error))
    body.append("\n\nretrying", style="dim")
    if last_ok is not None:
        body.append(f" · last update {_age(now - last_ok)} ago", style="dim")
    body.append(" · Ctrl-C to quit", style="dim")
    return Panel(body, title=f"meshd node {base_url}", title_align="left", border_style="red")


def waiting(client: NodeClient) -> list[Mapping[str, Any]]:
    """The nodes waiting for approval at ``client``'s node; none in an open cluster or
    when the node does not say (the cluster view must not fail for it)."""
    try:
        return [_dict(p) for p in _list(client.members().get("pending"))]
    except MeshctlError:
        return []


def _frame(
    client: NodeClient, interval: float, pending: list[Mapping[str, Any]], status: str
) -> RenderableType:
    now = time.time()
    cluster = client.cluster()
    pending[:] = waiting(client)
    keys = "1-9 approve · q or Ctrl-C to quit" if _keys_available() else "Ctrl-C to quit"
    footer = Text(
        f"{client.base_url} · {time.strftime('%H:%M:%S', time.localtime(now))}"
        f" · every {interval:g}s · {keys}",
        style="dim",
    )
    parts: list[RenderableType] = [render(cluster, int(now * 1000), pending), footer]
    if status:
        parts.append(Text(status, style="bold"))
    return Group(*parts)


def _keys_available() -> bool:
    return sys.platform != "win32" and sys.stdin.isatty()


@contextlib.contextmanager
def _cbreak() -> Iterator[None]:
    """Keys reach ``_key`` one at a time, unechoed, while the view runs (a terminal only)."""
    if not _keys_available():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _key(timeout: float) -> str:
    """A key pressed within ``timeout`` seconds, or "" (then it just waited)."""
    if not _keys_available():
        time.sleep(timeout)
        return ""
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return os.read(sys.stdin.fileno(), 1).decode(errors="replace") if ready else ""


def approve_key(client: NodeClient, key: str, pending: list[Mapping[str, Any]]) -> str:
    """Approve the waiting node numbered ``key``; what happened, in one line."""
    if not key.isdigit() or not 1 <= int(key) <= len(pending):
        return ""
    p = pending[int(key) - 1]
    ref = str(p.get("id") or p.get("name") or "")
    try:
        m = client.approve(ref)
    except MeshctlError as exc:
        return f"could not approve {p.get('name')}: {exc}"
    return f"approved {m.get('name')} ({m.get('id')}); it joins within a few seconds"


def run_top(
    client: NodeClient,
    interval: float = 1.0,
    once: bool = False,
    console: Console | None = None,
    as_json: bool = False,
) -> int:
    """Draw the cluster as ``client``'s node sees it; returns the exit code.

    ``as_json``: print :func:`snapshot` as one JSON document and return 0. ``once``:
    print one frame and return 0; an unreachable node raises NodeUnreachable
    (and a bad answer NodeError) for the caller to report. Otherwise redraw every
    ``interval`` seconds in a ``rich.live.Live`` until Ctrl-C (which returns 0); while
    the node is unreachable an error panel replaces the frame, and the frame returns
    when the node does. When stdout is not a terminal, frames are printed one after
    another instead of redrawn.
    """
    console = console or stdout_console()
    if as_json:
        # One JSON document, no markup: for scripts and monitors.
        print(json.dumps(snapshot(client.cluster())), flush=True)
        return 0
    if once:
        cluster = client.cluster()
        console.print(render(cluster, int(time.time() * 1000), waiting(client)))
        return 0

    last_ok: float | None = None
    pending: list[Mapping[str, Any]] = []
    status = ""

    def frame() -> RenderableType:
        nonlocal last_ok
        try:
            out = _frame(client, interval, pending, status)
        except MeshctlError as exc:
            return error_panel(exc, client.base_url, last_ok, time.time())
        except Exception as exc:  # a malformed answer must not kill the view
            return error_panel(
                MeshctlError(f"cannot draw the cluster view: {exc!r}"),
                client.base_url,
                last_ok,
                time.time(),
            )
        last_ok = time.time()
        return out

    try:
        if not console.is_terminal:
            while True:
                console.print(frame())
                console.rule(style="dim")
                time.sleep(interval)
        with _cbreak(), Live(frame(), console=console, auto_refresh=False) as live:
            next_at = time.monotonic() + interval
            while True:
                key = _key(max(0.0, next_at - time.monotonic()))
                if key in ("q", "Q"):
                    return 0
                if key:
                    said = approve_key(client, key, pending)
                    if not said:
                        continue  # not a key of ours: keep waiting for the next frame
                    status = said
                next_at = time.monotonic() + interval
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        return 0

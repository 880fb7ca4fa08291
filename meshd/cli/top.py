"""``meshctl top``: a live view of the cluster as one node sees it.

``render`` is pure: it turns the JSON of ``GET /v1/cluster`` (the nodes: cards,
heartbeats, liveness), of ``GET /v1/instances`` (each instance as the node itself sees
it: stage states, exclusions and their reasons, speeds; see
``meshd.api.instance_view``) and the nodes waiting for approval (``GET /v1/members``)
into a rich renderable, and reads no clock and no network, so it can be tested with
literal dicts. It shows what the node says and derives no rule of its own: whether a
stage is ready, why a node is left out of an instance, how fast it runs are the node's
answers. ``run_top`` fetches and draws, once or in a ``rich.live.Live`` loop; on a
terminal, the keys 1-9 pick the waiting node of that number to approve (then type the
code its screen shows, Enter) and q quits.

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

from .approving import CodePrompt
from .client import MeshctlError

if TYPE_CHECKING:
    from .client import NodeClient

LIVENESS_STYLE = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}
RUNNER_STYLE = {
    "ready": "green", "fetching": "cyan", "loading": "yellow", "failed": "red", "stopped": "dim",
    "unloaded": "dim", "pending": "dim", "unavailable": "red",
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


def node_speed(node: Mapping[str, Any]) -> dict[str, float]:
    """A node's ``tokens_s`` (what its API streams now) and ``in_flight`` requests."""
    health = _dict(node.get("health"))
    serving = [_dict(v) for v in _dict(health.get("serving")).values()]
    tps = _num(health.get("tokens_s")) or 0.0
    return {"tokens_s": tps, "in_flight": sum(_num(v.get("in_flight")) or 0 for v in serving)}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"


def _sorted_instances(instances: Any) -> list[Mapping[str, Any]]:
    return sorted(map(_dict, _list(instances)), key=lambda i: str(i.get("id")))


def snapshot(cluster: Mapping[str, Any], instances: Any) -> dict[str, Any]:
    """What ``top`` shows, for machines (``meshctl top --json``): every node's liveness
    and speed (``GET /v1/cluster``), every instance's state, speed and stages (``data``
    of ``GET /v1/instances``)."""
    names = _names(cluster)
    nodes = []
    for node in _sorted_nodes(cluster):
        health = _dict(node.get("health"))
        nodes.append({
            "id": node.get("id"), "name": names.get(str(node.get("id"))),
            "liveness": node.get("liveness"), "state": health.get("state"),
            "mem_available": health.get("mem_available"), "load": health.get("load"),
            "decode_bps": health.get("decode_bps", 0.0), "rtt_ms": health.get("rtt_ms", {}),
            "bw_mbps": health.get("bw_mbps", {}), **node_speed(node),
        })  # fmt: skip
    out = []
    for inst in _sorted_instances(instances):
        stages = [
            {k: st.get(k) for k in ("node", "name", "start", "end", "engine", "state",
                                    "ms_per_token")}
            for st in map(_dict, _list(inst.get("stages")))
        ]  # fmt: skip
        out.append({
            "id": inst.get("id"), "model": inst.get("model"),
            "generation": inst.get("generation"), "state": inst.get("state"),
            **_dict(inst.get("speed")), "stages": stages,
            **{k: inst.get(k) for k in ("predicted_tokens_s", "predicted_transfer_s",
                                        "measured_tokens_s")},
            "excluded": _list(inst.get("excluded")),
        })  # fmt: skip
    return {"cluster": cluster.get("cluster"), "self": cluster.get("self"), "nodes": nodes,
            "instances": out}  # fmt: skip


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


def _runner_state(state: Any) -> Text:
    word = str(state) if state else "?"
    return Text(word, style=RUNNER_STYLE.get(word, ""))


def _lines(parts: Iterable[Text]) -> Text:
    parts = list(parts)
    return Text("\n").join(parts) if parts else Text("-", style="dim")


def _stream(pred: Any, real: Any) -> str:
    """One request's tokens/s: placement's prediction, and what was measured:
    ``41/38``, ``-`` for a figure not known yet."""
    pred, real = _num(pred) or 0.0, _num(real) or 0.0
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


def _fetch_note(st: Mapping[str, Any]) -> str:
    """``37% of 49 MB, 20.5 MB/s``: how far a stage's weights fetch is."""
    done, total = _num(st.get("fetched")) or 0, _num(st.get("fetch_total")) or 0
    rate = _num(st.get("fetch_rate")) or 0.0
    if not total:
        return "(asking holders)"
    return f"{100 * done / total:.0f}% of {total / 1e6:.0f} MB, {rate / 1e6:.1f} MB/s"


def stage_line(st: Mapping[str, Any]) -> Text:
    """``studio[0:48) mlx ready 12.5 ms``: one stage of an instance view, as the node
    states it (its runner's state and why, its node's liveness when not alive)."""
    nid = str(st.get("node") or "?")
    line = Text(str(st.get("name") or short_id(nid)))
    line.append(f"[{st.get('start', '?')}:{st.get('end', '?')})")
    if st.get("engine"):
        line.append(f" {st['engine']}", style="cyan")
    line.append(" ")
    state = st.get("state")
    line.append_text(_runner_state(state))
    if state == "fetching":
        line.append(f" {_fetch_note(st)}", style="cyan")
    # An unavailable stage's reason only says its node is not live: its liveness
    # below says how.
    if st.get("reason") and state != "unavailable":
        line.append(f" ({st['reason']})", style="dim")
    liveness = st.get("liveness")
    if liveness and liveness != "alive":
        line.append(f" (node {liveness})", style=LIVENESS_STYLE.get(str(liveness), ""))
    ms = _num(st.get("ms_per_token"))
    if ms is not None:
        line.append(f" {_ms(ms)}", style="magenta")
    return line


def excluded_line(x: Mapping[str, Any]) -> Text:
    """``excluded tower (fetch failed: ...)``: a node the instance leaves out, and why."""
    line = Text("excluded ", style="red")
    line.append(str(x.get("name") or short_id(str(x.get("node") or "?"))), style="bold")
    line.append(f" ({x.get('reason') or '?'})", style="dim")
    return line


def instances_table(instances: Any) -> FitTable:
    """One row per placed instance of ``GET /v1/instances``: its speed over the last
    minute (tokens/s, requests in flight, queue, median time to first token and between
    tokens), one line per stage (``node[start:end) engine state`` and its ms per
    token), the per-hop ms, and the nodes it leaves out with their reasons."""
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
    insts = _sorted_instances(instances)
    for inst in insts:
        speed = _dict(inst.get("speed"))
        lines = [stage_line(st) for st in map(_dict, _list(inst.get("stages")))]
        hop = _num(speed.get("hop_ms"))
        if hop is not None:
            lines.append(Text(f"hop {_ms(hop)}", style="dim magenta"))
        lines += [excluded_line(x) for x in map(_dict, _list(inst.get("excluded")))]
        rows.append([
            Text(str(inst.get("id") or "?")), Text(str(inst.get("model") or "?")),
            Text(str(inst.get("generation", "?"))),
            Text(f"{_num(speed.get('tokens_s')) or 0.0:.1f}"),
            Text(str(int(_num(speed.get("in_flight")) or 0))),
            Text(str(int(_num(speed.get("queue")) or 0))),
            Text(_ms(_num(speed.get("ttft_ms")))), Text(_ms(_num(speed.get("itl_ms")))),
            Text(_stream(inst.get("predicted_tokens_s"), inst.get("measured_tokens_s"))),
            _lines(lines),
        ])  # fmt: skip
    return FitTable("instances", columns, rows, caption=None if insts else "no instances placed")


def header(cluster: Mapping[str, Any], instances: Any) -> Text:
    """``cluster home · 2/3 nodes alive · 1 instance · via mini (1a2b3c4d)``."""
    nodes = [_dict(n) for n in _list(cluster.get("nodes"))]
    alive = sum(1 for n in nodes if n.get("liveness") == "alive")
    n_inst = len(_list(instances))
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
        title="waiting to join (press its number, then type its code)",
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
    instances: Any,
    now_ms: int | None = None,
    pending: list[Mapping[str, Any]] | None = None,
) -> RenderableType:
    """The whole ``top`` frame for one ``GET /v1/cluster`` answer and the ``data`` of one
    ``GET /v1/instances`` answer, and the nodes waiting for approval (the ``pending``
    list of ``GET /v1/members``) when there are any.

    Pure: ``now_ms`` (wall clock, ms) is only used for node uptimes, shown as ``-`` when
    it is None.
    """
    parts: list[RenderableType] = [
        header(cluster, instances), Text(), nodes_table(cluster, now_ms), Text(),
        instances_table(instances),
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


def fetch_view(client: NodeClient) -> tuple[dict[str, Any], list[Any]]:
    """What a frame shows: the cluster's nodes (``GET /v1/cluster``) and the node's
    view of every instance (``GET /v1/instances``)."""
    cluster = client.cluster()
    return cluster, _list(client.instances().get("data"))


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
    cluster, instances = fetch_view(client)
    pending[:] = waiting(client)
    keys = "1-9 approve · q or Ctrl-C to quit" if _keys_available() else "Ctrl-C to quit"
    footer = Text(
        f"{client.base_url} · {time.strftime('%H:%M:%S', time.localtime(now))}"
        f" · every {interval:g}s · {keys}",
        style="dim",
    )
    parts: list[RenderableType] = [render(cluster, instances, int(now * 1000), pending), footer]
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
        print(json.dumps(snapshot(*fetch_view(client))), flush=True)
        return 0
    if once:
        cluster, instances = fetch_view(client)
        console.print(render(cluster, instances, int(time.time() * 1000), waiting(client)))
        return 0

    last_ok: float | None = None
    pending: list[Mapping[str, Any]] = []
    status, prompt = "", CodePrompt()

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
                if key in ("q", "Q") and not prompt.active:
                    return 0
                if key:
                    said = prompt.key(client, key, pending)
                    if said is None:
                        continue  # not a key of ours: keep waiting for the next frame
                    status = said
                next_at = time.monotonic() + interval
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        return 0

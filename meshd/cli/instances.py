"""How ``meshctl place`` and ``meshctl ls`` show instances: where each stage runs (the
node's name, which it gives itself, and its id, which says which machine it is), and a
progress bar per stage while they load."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from .client import NodeClient
from .top import stdout_console

__all__ = ["print_instances", "stage_progress", "wait_serving"]


def stage_progress(stage: Mapping[str, Any], fetched_total: int) -> tuple[int | None, int, str]:
    """One stage's bar: ``(total, done, bytes)``, from its view in ``/v1/instances``
    and ``fetched_total``, the size of a fetch seen earlier (0: none).

    Bytes show only while a fetch runs (the node sends 0s otherwise) and once it ended:
    then the bar stays full, not back at 0 of the size. A stage that fetches nothing
    has no size: its bar pulses (total None) while it loads."""
    total = int(stage.get("fetch_total") or 0)
    if stage.get("state") == "fetching" and total > 0:
        done = int(stage.get("fetched") or 0)
        return total, done, f"{done / 1e6:.1f}/{total / 1e6:.1f} MB"
    if fetched_total > 0 and stage.get("state") != "fetching":
        return fetched_total, fetched_total, f"{fetched_total / 1e6:.1f} MB fetched"
    return None, 0, ""


def wait_serving(client: NodeClient, inst: dict, timeout: float) -> dict:
    """Poll the instance until every stage is ready, a stage failed, or ``timeout``,
    showing one progress bar per stage (bytes while it fetches its weights)."""
    from rich.progress import BarColumn, Progress, TextColumn

    names = {n["id"]: n["name"] for n in client.cluster().get("nodes") or []}
    deadline = time.monotonic() + timeout
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[bytes]}"),
               TextColumn("{task.fields[state]}"))  # fmt: skip
    with Progress(*columns, console=stdout_console(), transient=True) as bar:
        tasks = [
            bar.add_task(
                f"{names.get(s['node'], s['node'][:8])}[{s['start']}:{s['end']})",
                total=None,
                state="",
                bytes="",
            )
            for s in inst.get("stages") or []
        ]
        sizes = dict.fromkeys(tasks, 0)  # each stage's fetch, once seen
        while True:
            stages = inst.get("stages") or []
            for t, s in zip(tasks, stages, strict=False):
                total, done, size = stage_progress(s, sizes[t])
                sizes[t] = total or 0
                bar.update(t, total=total, completed=done, bytes=size, state=s.get("state", ""))
            states = [s.get("state") for s in stages]
            if all(st == "ready" for st in states) or "failed" in states:
                return inst
            if time.monotonic() > deadline:
                return inst
            time.sleep(0.5)
            inst = client.instance(inst["id"])


def print_instances(data: list, client: NodeClient) -> None:
    """The instances as a table: each stage with its node's name and id, its layers,
    engine and state, and the nodes it is kept off and why."""
    from rich.markup import escape  # names, models, reasons: members wrote them
    from rich.table import Table

    names = {n["id"]: n["name"] for n in client.cluster().get("nodes") or []}
    t = Table(box=None, header_style="bold")
    # The draft column only where some instance has a draft model drafting for it.
    drafts = any(inst.get("draft") for inst in data)
    for col in ("id", "model", "gen", "stages", *(["draft"] if drafts else [])):
        t.add_column(col)
    for inst in data:
        # Names are what nodes call themselves: the id says which machine it is.
        stages = "\n".join(
            f"{names.get(s['node'], '?')} ({s['node'][:8]})[{s['start']}:{s['end']}) "
            f"{s['engine']} "
            f"{s.get('state', '')}{' (' + s['reason'] + ')' if s.get('reason') else ''}"
            for s in inst.get("stages") or []
        )
        for x in inst.get("excluded") or []:
            stages += f"\nnot on {x.get('name') or '?'} ({x['node'][:8]}): {x.get('reason')}"
        # An exact instance says so by its model: its requests run slower on purpose.
        model = inst["model"] + (" (exact)" if inst.get("exact") else "")
        row = [inst["id"], model, str(inst.get("generation", "")), stages]
        t.add_row(*map(escape, [*row, *([inst.get("draft") or ""] if drafts else [])]))
    if not data:
        print("no instances placed")
        return
    stdout_console().print(t)

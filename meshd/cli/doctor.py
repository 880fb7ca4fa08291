"""``meshctl doctor``: why a peer is missing or a model does not serve, as one node sees it.

The node does the diagnosis (``GET /v1/doctor``); this prints it: each finding on one
line (its severity and what is wrong) with its fix on the next, then what was checked.
``render`` is pure (a dict in, a rich renderable out), so it is tested with literals.
Exit code: 1 when a finding is an error, else 0.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from .client import NodeClient
from .top import stdout_console

__all__ = ["exit_code", "render", "run_doctor"]

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
_MARK = {"error": "✗", "warning": "!", "info": "i"}


def _findings(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    got = report.get("findings")
    return [f for f in got if isinstance(f, Mapping)] if isinstance(got, list) else []


def exit_code(report: Mapping[str, Any]) -> int:
    """1 when any finding is an error, else 0."""
    return 1 if any(f.get("severity") == "error" for f in _findings(report)) else 0


def render(report: Mapping[str, Any]) -> RenderableType:
    """The report as lines: findings worst first (what, then ``fix:``), then a summary
    and what was checked. Text from the node is never read as rich markup."""
    lines: list[RenderableType] = []
    findings = _findings(report)
    who = f"{report.get('name') or '?'} ({report.get('node') or '?'})"
    lines.append(Text.assemble(("meshctl doctor", "bold"), f" at node {who}"))
    for f in findings:
        sev = str(f.get("severity") or "info")
        style = _STYLE.get(sev, "")
        line = Text.assemble(
            (f"{_MARK.get(sev, '?')} {sev:<7} ", style),
            (str(f.get("what") or ""), ""),
            (f"  [{f.get('code')}]" if f.get("code") else "", "dim"),
        )
        lines.append(line)
        if f.get("fix"):
            lines.append(Text.assemble(("          fix: ", "dim"), str(f.get("fix"))))
    counts = {s: sum(1 for f in findings if f.get("severity") == s) for s in _STYLE}
    if not findings:
        lines.append(Text("✓ nothing wrong found", style="green"))
    else:
        summary = ", ".join(f"{n} {s}{'s' if n > 1 else ''}" for s, n in counts.items() if n)
        lines.append(Text(summary, style="bold red" if counts["error"] else "yellow"))
    checked = report.get("checked")
    if isinstance(checked, list) and checked:
        lines.append(Text("checked:", style="dim"))
        for c in checked:
            if isinstance(c, Mapping):
                lines.append(Text(f"  {c.get('name')}: {c.get('detail')}", style="dim"))
    return Group(*lines)


def run_doctor(client: NodeClient, *, as_json: bool = False) -> int:
    """Ask the node, print the report, return the exit code (1: an error found)."""
    report = client.doctor()
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        # soft_wrap: a finding stays one line however narrow the terminal or the pipe.
        stdout_console().print(render(report), soft_wrap=True)
    return exit_code(report)

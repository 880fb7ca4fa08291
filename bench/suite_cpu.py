"""Where a command's CPU goes, by kind of process: for the test suite, which of runners,
nodes, pytest workers, meshctl and the type checker use the machine's cores.

    python bench/suite_cpu.py -- bash .ci/run            # the whole CI run
    python bench/suite_cpu.py --top 30 -- python3 -m pytest tests/node -q

Runs the command and, once a second until it ends, reads every process's CPU time from
/proc (Linux only). A process is counted at the last sample that saw it, so one that
lives less than a second may be missed or undercounted. Every process that starts
while it runs is counted, the command's or not (run it on a quiet machine); those
running before it started are left out. Prints CPU seconds per kind, then the
processes that used the most.

A diagnostic, not a test: it prints figures and exits with the command's status.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

#: (substring of the command line, kind), the first that matches wins.
KINDS = [
    ("meshd.engines.runner", "runner"),
    ("meshd.cli.meshd up", "node"),
    ("bin/meshd up", "node"),
    ("meshctl", "meshctl"),
    ("exec(eval(sys.stdin.readline()))", "pytest worker"),
    ("pytest", "pytest"),
    ("mypy", "mypy"),
    ("ruff", "ruff"),
    ("chromium", "chromium"),
    ("python", "other python"),
]


def kind(cmdline: str) -> str:
    """The kind of process a command line names."""
    for needle, name in KINDS:
        if needle in cmdline:
            return name
    return "other"


def sample(seen: dict[tuple[str, str], tuple[str, float, str]], before: set[str]) -> None:
    """Read every process's CPU seconds (user + system) into ``seen``."""
    hz = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in before:
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / hz
        key = (pid, fields[19])  # a pid and its start time: one process
        old = seen.get(key)
        if cmd.strip():
            seen[key] = (kind(cmd), cpu, cmd.strip())
        elif old is not None:  # exiting: its command line is gone, its times are final
            seen[key] = (old[0], max(cpu, old[1]), old[2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=15, help="processes listed (default 15)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given")
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    seen: dict[tuple[str, str], tuple[str, float, str]] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        sample(seen, before)
        time.sleep(1.0)
    wall = time.monotonic() - t0
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for k, cpu, _ in seen.values():
        total[k] += cpu
        count[k] += 1
    print(f"\n{wall:.0f} s wall, {sum(total.values()):.0f} CPU-seconds seen", file=sys.stderr)
    for k, cpu in total.most_common():
        print(f"{cpu:9.1f} s  {count[k]:5d} processes  {k}", file=sys.stderr)
    print(file=sys.stderr)
    for k, cpu, line in sorted(seen.values(), key=lambda r: -r[1])[: args.top]:
        print(f"{cpu:8.1f} s  {k:14s} {line[:110]}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

"""Run a command as a child subreaper and report what it left running.

    python tests/examples/reaper.py --report OUT.json --timeout S -- CMD [ARGS...]

The command's stdout and stderr are this process's. Every process the command starts
stays this process's descendant, even one whose parent exits (PR_SET_CHILD_SUBREAPER,
Linux): so once the command has ended, whatever still runs of it is found, reported and
killed. The report (JSON): ``rc`` (the command's exit code), ``timed_out``,
``subreaper`` (whether leftovers could be tracked), ``leftovers`` (the command lines of
the processes that outlived the command by ``--grace`` seconds).

Past ``--timeout`` the command gets SIGTERM (a script's trap can still stop what it
started), then SIGKILL ``--kill-after`` seconds later.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def reap() -> None:
    """Collect every exited child (orphans adopted by this process included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def live_descendants() -> list[psutil.Process]:
    reap()
    out = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid}: {' '.join(p.cmdline())}"
    except psutil.Error:
        return f"{p.pid}: ?"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--kill-after", type=float, default=45.0)
    ap.add_argument("--grace", type=float, default=5.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    subreaper = become_subreaper()
    proc = subprocess.Popen(cmd)
    timed_out = False
    try:
        rc = proc.wait(args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(args.kill_after)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    deadline = time.monotonic() + args.grace
    left = live_descendants()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = live_descendants()
    leftovers = [describe(p) for p in left]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=5)
    reap()
    with open(args.report, "w") as f:
        json.dump(
            {"rc": rc, "timed_out": timed_out, "subreaper": subreaper, "leftovers": leftovers}, f
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

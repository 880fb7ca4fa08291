"""Facts about this machine for the node card and heartbeats."""

from __future__ import annotations

import os
import platform

import psutil


def os_name() -> str:
    """``linux``, ``darwin``, ``windows``..."""
    return platform.system().lower()


def arch() -> str:
    """CPU architecture, e.g. ``x86_64`` or ``arm64``."""
    return platform.machine().lower()


def cpu_count() -> int:
    """CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def mem_total() -> int:
    """Physical memory in bytes."""
    return int(psutil.virtual_memory().total)


def mem_available() -> int:
    """Memory available to new work, in bytes."""
    return int(psutil.virtual_memory().available)


def load() -> float:
    """1-minute load average divided by CPU count (0 where the OS has none)."""
    try:
        return os.getloadavg()[0] / max(1, cpu_count())
    except (AttributeError, OSError):
        return 0.0

"""A throw-away LAN of Linux network namespaces, for tests that need real networking.

    with Netns.lan(n=2, prefix="mdt") as lan:
        p = lan.hosts[0].popen(["python", "-c", "..."], stdout=subprocess.PIPE)
        lan.hosts[1].ip          # "10.99.0.11"
        lan.cut(1); lan.heal(1)  # unplug / replug host 1's cable

Layout: one "switch" namespace holds a bridge ``br0``; each host namespace holds
``lo`` and ``eth0``, the far end of a veth pair whose near end (``p<i>``) is a port of
the bridge. Every link is created inside the namespaces (``ip -n``), so nothing is
ever added to, or changed in, the machine's own network namespace, and the 10.x test
subnet exists only inside them. Multicast is on, IGMP snooping is off and
224.0.0.0/4 is routed to ``eth0`` so mDNS works between hosts.

Names carry a prefix, this process's pid and a serial, so parallel or aborted runs
never collide; a later run reaps namespaces whose creating process is gone. Cleanup
(processes started through ``popen``, any other process left in a namespace, then
the namespaces, which takes their links with them) runs on ``__exit__`` and, as a
backstop, at interpreter exit.

Needs root and iproute2; ``netns_available()`` says whether this machine can.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytest

_serial = itertools.count()
_live: set[Lan] = set()
_NAME_RE = re.compile(r"^(?P<prefix>[a-z0-9]+)-(?P<pid>\d+)-\d+-(?:sw|h\d+|probe)$")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise RuntimeError with its stderr when it fails and ``check``."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def delete_netns(name: str) -> None:
    """Kill every process left in namespace ``name`` (but this one, which may have
    entered it and left), then delete it (its veths and TUNs go with it)."""
    out = ip("netns", "pids", name, check=False).stdout
    for word in out.split():
        if word == str(os.getpid()):
            continue
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(word), signal.SIGKILL)
    ip("netns", "del", name, check=False)


def reap_stale(prefix: str, pattern: re.Pattern[str] = _NAME_RE) -> list[str]:
    """Delete namespaces named ``<prefix>-<pid>-...`` (as ``pattern`` reads them)
    whose creating process is dead."""
    reaped = []
    for name in _netns_names():
        m = pattern.match(name)
        if m and m["prefix"] == prefix and not pid_alive(int(m["pid"])):
            delete_netns(name)
            reaped.append(name)
    return reaped


@functools.lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """Whether this machine can build a test LAN: ``(True, "")`` or ``(False, why)``."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is not 0)"
    if shutil.which("ip") is None:
        return False, "iproute2 `ip` command not found"
    name = f"mdprobe-{os.getpid()}-{next(_serial)}-probe"
    try:
        ip("netns", "add", name)
        try:
            ip("-n", name, "link", "add", "br0", "type", "bridge")
            ip("-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
            ip("-n", name, "link", "set", "lo", "up")
            exe = subprocess.run(
                ["ip", "netns", "exec", name, "true"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            if exe.returncode != 0:
                return False, f"`ip netns exec` failed: {exe.stderr.strip()}"
        finally:
            delete_netns(name)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot build a namespace with bridge and veth: {exc}"
    return True, ""


class Netns:
    """One network namespace; ``popen``/``run`` execute commands inside it."""

    def __init__(self, name: str, lan: Lan | None = None) -> None:
        self.name = name
        self._lan = lan

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside this namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the namespace, in its own session (so its whole
        process group is killed at cleanup)."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(argv), **kw)
        if self._lan is not None:
            self._lan.procs.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], timeout: float = 10, **kw: Any
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the namespace to completion (output captured as text)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(argv), timeout=timeout, check=False, **kw)

    @staticmethod
    def lan(n: int = 2, prefix: str = "mdt", subnet: str = "10.99.0") -> Lan:
        """A context manager building ``n`` hosts on one bridge (see module doc)."""
        return Lan(n=n, prefix=prefix, subnet=subnet)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Host(Netns):
    """A host namespace on the LAN: ``eth0`` has ``ip`` (a /24 of the test subnet)."""

    def __init__(self, name: str, lan: Lan, index: int, ip: str) -> None:
        super().__init__(name, lan)
        self.index = index
        self.ip = ip
        self.port = f"p{index}"  # its port on the switch's bridge


class Lan:
    """``n`` host namespaces joined through a bridge in a switch namespace."""

    def __init__(self, n: int = 2, prefix: str = "mdt", subnet: str = "10.99.0") -> None:
        if not re.fullmatch(r"[a-z0-9]+", prefix):
            raise ValueError("prefix must be lowercase letters and digits")
        if not 1 <= n <= 200:
            raise ValueError("n must be between 1 and 200")
        self.prefix = prefix
        self.subnet = subnet
        base = f"{prefix}-{os.getpid()}-{next(_serial)}"
        self.switch = Netns(f"{base}-sw", self)
        self.hosts = [Host(f"{base}-h{i}", self, i, f"{subnet}.{10 + i}") for i in range(n)]
        self.procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        self._closed = False

    # -- building --------------------------------------------------------------------

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        reap_stale(self.prefix)
        sw = self.switch.name
        self._add_netns(sw)
        ip("-n", sw, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        ip("-n", sw, "link", "set", "br0", "multicast", "on", "up")
        for host in self.hosts:
            self._add_netns(host.name)
            ip("-n", sw, "link", "add", host.port, "type", "veth",
                "peer", "name", "eth0", "netns", host.name)  # fmt: skip
            ip("-n", sw, "link", "set", host.port, "master", "br0")
            ip("-n", sw, "link", "set", host.port, "multicast", "on", "up")
            ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            ip("-n", host.name, "link", "set", "eth0", "multicast", "on", "up")
            ip("-n", host.name, "route", "add", "224.0.0.0/4", "dev", "eth0")

    def __enter__(self) -> Lan:
        _live.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- partitions --------------------------------------------------------------------

    def cut(self, i: int) -> None:
        """Unplug host ``i``: its switch port goes down (its ``eth0`` loses carrier)."""
        ip("-n", self.switch.name, "link", "set", self.hosts[i].port, "down")

    def heal(self, i: int) -> None:
        """Plug host ``i`` back in."""
        ip("-n", self.switch.name, "link", "set", self.hosts[i].port, "up")

    # -- cleanup -----------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started here, then delete the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        self._stop_procs()
        for name in reversed(self._made):
            delete_netns(name)
        self._made.clear()

    def _stop_procs(self, grace_s: float = 2.0) -> None:
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=2)
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


@atexit.register
def _close_all() -> None:
    for lan in list(_live):
        lan.close()


def require_netns() -> None:
    """Fail (not skip) without namespaces, unless MESHD_ALLOW_NO_NETNS=1 says skip."""
    ok, reason = netns_available()
    if ok:
        return
    if os.environ.get("MESHD_ALLOW_NO_NETNS") == "1":
        pytest.skip(f"network namespaces unavailable: {reason}")
    pytest.fail(
        f"network namespaces unavailable: {reason} "
        "(set MESHD_ALLOW_NO_NETNS=1 to skip these tests instead)",
        pytrace=False,
    )

"""Hosts in network namespaces joined by a router whose links add a fixed delay.

This kernel has no ``sch_netem``, so the delay is made in user space: every packet
between two hosts is routed through one TUN device in the router namespace, a relay
process reads it from the TUN, holds it for the one-way delay, and writes it back into
the same TUN, from which the kernel forwards it to its destination.

    with DelayLan(n=2, prefix="mdl") as lan:   # hosts 10.77.1.2, 10.77.2.2, ...
        lan.set_rtt(5.0)                       # ms; each direction holds RTT/2
        lan.set_rate(100)                      # Mbit/s each way of each host pair
        lan.hosts[1].popen([...])              # a process inside host 1
        print(lan.ping(0, 1, count=20))        # measured RTT min/avg/max (ms)

Layout:

* host namespace ``<base>-h<i>``: ``lo`` and ``eth0`` (``10.77.<i+1>.2/24``), default
  route via the router;
* router namespace ``<base>-rt``: the near end ``v<i>`` of every host's veth pair
  (``10.77.<i+1>.1/24``) and ``tun0``; ``ip_forward=1``, ``rp_filter=0``; a policy rule
  sends everything that arrives on a ``v<i>`` port to table 100 (``default dev tun0``);
  what the relay writes back arrives on ``tun0`` and follows the main table (the
  connected host subnets). Both directions cross the relay once, so each holds half the
  RTT (``set_rtt(r)`` sets a one-way delay of ``r / 2``).

The relay (``python bench/_delay.py relay``, run inside the router namespace) is one
thread: ``select`` on the non-blocking TUN fd with the first packet's due time as the
timeout (microsecond resolution, unlike ``epoll``'s milliseconds), a heap of
``(due, packet)``, and one line per command on stdin (``delay MS``: the one-way delay;
``rate MBIT``: each link's bandwidth, 0 for none).

Each direction of each host pair (a packet's source and destination address) is a link
of its own, with a wire that sends one packet at a time: a packet is due at the later
of its arrival plus the delay and the previous packet's departure on its link plus its
own size (its IP bytes) * 8 / rate. So a burst leaves at the link's rate after the
delay, as from a switch port of that speed, and packets of one link never pass each
other (a lower delay set later waits for those queued before it); links do not share
bandwidth (a full-duplex switched LAN, not one Wi-Fi medium). ``DelayLan.set_rate``
sets it. It runs on the machine's own cores, so its
wake-up latency adds to the target: ``ping`` with ``set_rtt(0)`` measures that. It
runs at a real-time priority (``SCHED_FIFO``), so the compute on the same cores delays
its wake-ups less.

Names carry a prefix, this process's pid and a serial, so parallel or aborted runs
never collide; a later run reaps namespaces whose creating process is gone. Cleanup
(the relay and every process started through ``popen``, anything else left in a
namespace, then the namespaces, which take their veths and the TUN with them) runs on
``__exit__`` and, as a backstop, at interpreter exit. Needs root and iproute2.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import heapq
import itertools
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The namespace helpers are the test suite's (tests/netns.py): one copy of how a
# namespace is made, emptied and reaped. Run as a script, the repository root is not
# on the path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import netns

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
TABLE = "100"

_serial = itertools.count()
_live: set[DelayLan] = set()
_NAME_RE = re.compile(r"^(?P<prefix>[a-z0-9]+)-(?P<pid>\d+)-\d+-(?:rt|h\d+)$")


def reap_stale(prefix: str) -> list[str]:
    """Delete namespaces ``<prefix>-<pid>-...`` whose creating process is gone."""
    return netns.reap_stale(prefix, _NAME_RE)


def available(ping: bool = True) -> tuple[bool, str]:
    """``(True, "")`` when this machine can build a delayed LAN, else ``(False, why)``;
    ``ping``: and check its links with ``ping``."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces and TUN devices need root"
    if not os.path.exists("/dev/net/tun"):
        return False, "no /dev/net/tun (the tun module is not loaded)"
    if shutil.which("ip") is None:
        return False, "iproute2 `ip` command not found"
    if ping and shutil.which("ping") is None:
        return False, "`ping` not found (it checks the links' delay; Debian: iputils-ping)"
    return True, ""


# -- the relay (runs inside the router namespace) ----------------------------------------


def open_tun(name: str) -> int:
    """Create (or attach to) TUN device ``name`` in this namespace; a non-blocking fd
    carrying bare IP packets (``IFF_NO_PI``)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def relay_main(argv: Sequence[str]) -> int:
    """``relay DEV DELAY_MS``: hold every packet read from DEV for DELAY_MS (and its
    link's rate), then write it back. Prints ``ready`` once the device exists; reads
    ``delay MS`` and ``rate MBIT`` lines on stdin (answers ``ok ...``); exits when
    stdin closes."""
    dev = argv[0]
    wire = Wire(float(argv[1]) / 1000.0)
    _fine_timers()
    fd = open_tun(dev)
    ctl = sys.stdin.fileno()
    os.set_blocking(ctl, False)
    buf = b""
    now = time.perf_counter
    print("ready", flush=True)
    while True:
        timeout = None
        if wire.heap:
            timeout = max(0.0, wire.heap[0][0] - now())
        r, _, _ = select.select([fd, ctl], [], [], timeout)
        if fd in r:
            t = now()
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if wire.delay <= 0 and wire.rate <= 0 and not wire.heap:
                    _write(fd, pkt)
                else:
                    wire.hold(pkt, t)
        if ctl in r:
            try:
                chunk = os.read(ctl, 4096)
            except BlockingIOError:
                chunk = b"x"
            if not chunk:
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                answer = wire.command(line.split())
                if answer:
                    print(answer, flush=True)
        for pkt in wire.due(now()):
            _write(fd, pkt)


class Wire:
    """The relay's links: the one-way ``delay`` (s) and each link's ``rate``
    (bits/s, 0: none), and the packets held, by due time (see the module doc)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.rate = 0.0
        self.heap: list[tuple[float, int, bytes]] = []
        #: Per link (source, destination address): when its last packet leaves.
        self.free_at: dict[bytes, float] = {}
        self._n = itertools.count()

    def hold(self, pkt: bytes, t: float) -> None:
        """Queue ``pkt``, read at ``t``."""
        link = pkt[12:20]  # IPv4 source and destination
        send = len(pkt) * 8 / self.rate if self.rate > 0 else 0.0
        due = max(t + self.delay, self.free_at.get(link, 0.0) + send)
        self.free_at[link] = due
        heapq.heappush(self.heap, (due, next(self._n), pkt))

    def due(self, t: float) -> list[bytes]:
        """The packets due by ``t``, in order."""
        out = []
        while self.heap and self.heap[0][0] <= t:
            out.append(heapq.heappop(self.heap)[2])
        return out

    def command(self, parts: list[bytes]) -> str:
        """Act on a stdin line's words (``delay MS``, ``rate MBIT``); the answer."""
        if len(parts) != 2:
            return ""
        if parts[0] == b"delay":
            self.delay = float(parts[1]) / 1000.0
            return f"ok {self.delay * 1000:g}"
        if parts[0] == b"rate":
            self.rate = max(0.0, float(parts[1])) * 1e6
            return f"ok rate {self.rate / 1e6:g}"
        return ""


def _fine_timers() -> None:
    """Timer slack of 1 ns for this thread (the default 50 us adds to every hold), and
    a real-time priority: a LAN's wire does not wait for the hosts' CPUs, so the relay
    must not queue behind the compute it carries the traffic of (it sleeps in
    ``select`` between packets; the kernel keeps 5% of each second for the rest)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.nice(-10)


def _write(fd: int, pkt: bytes) -> None:
    # A full queue on the way out drops the packet, as a congested link does.
    with contextlib.suppress(BlockingIOError, OSError):
        os.write(fd, pkt)


# -- the LAN -------------------------------------------------------------------------------


class Host:
    """A host namespace: ``eth0`` has ``ip``, the default route goes via the router."""

    def __init__(self, lan: DelayLan, index: int, name: str) -> None:
        self.lan = lan
        self.index = index
        self.name = name
        self.ip = f"{lan.subnet}.{index + 1}.2"

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host (its own session; stopped at cleanup)."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.argv(argv), **kw)
        self.lan.procs.append(p)
        return p

    def run(
        self, argv: Sequence[str], timeout: float = 30, **kw: Any
    ) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(argv), timeout=timeout, check=False, **kw)

    def enter(self) -> None:
        """Move the calling thread into this host's network namespace (its sockets,
        127.0.0.1 included, are then this host's; children it starts inherit it).
        :meth:`DelayLan.close` moves it back first."""
        global _home
        if _home is None:
            _home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        fd = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
        try:
            _setns(fd, self.name)
        finally:
            os.close(fd)


#: The network namespace this process started in, once a thread entered a host's.
_home: int | None = None


def _setns(fd: int, what: str) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), f"setns into {what}")


def leave() -> None:
    """Move the calling thread back to the namespace the process started in."""
    if _home is not None:
        with contextlib.suppress(OSError):
            _setns(_home, "the first namespace")


@dataclass
class Ping:
    target_ms: float
    sent: int
    received: int
    min_ms: float
    avg_ms: float
    max_ms: float
    mdev_ms: float

    def row(self) -> list[str]:
        return [
            f"{self.target_ms:g}",
            f"{self.received}/{self.sent}",
            f"{self.min_ms:.3f}",
            f"{self.avg_ms:.3f}",
            f"{self.max_ms:.3f}",
            f"{self.mdev_ms:.3f}",
            f"{self.avg_ms - self.target_ms:+.3f}",
        ]


PING_HEADER = ["target RTT ms", "recv", "min", "avg", "max", "mdev", "avg - target"]
_RTT_RE = re.compile(r"= (?P<min>[\d.]+)/(?P<avg>[\d.]+)/(?P<max>[\d.]+)/(?P<mdev>[\d.]+) ms")
_RECV_RE = re.compile(r"(?P<sent>\d+) packets transmitted, (?P<recv>\d+) received")


class DelayLan:
    """``n`` host namespaces, each on its own veth to one router namespace whose
    forwarding passes through a delaying user-space relay (see the module doc)."""

    def __init__(
        self, n: int = 2, prefix: str = "mdl", subnet: str = "10.77", mtu: int = 1500
    ) -> None:
        if not re.fullmatch(r"[a-z0-9]+", prefix):
            raise ValueError("prefix must be lowercase letters and digits")
        if not 2 <= n <= 50:
            raise ValueError("n must be between 2 and 50")
        self.prefix = prefix
        self.subnet = subnet
        #: Of every link (9000: jumbo frames, a sixth of the packets for the relay).
        self.mtu = mtu
        base = f"{prefix}-{os.getpid()}-{next(_serial)}"
        self.router = f"{base}-rt"
        self.hosts = [Host(self, i, f"{base}-h{i}") for i in range(n)]
        self.procs: list[subprocess.Popen[Any]] = []
        self.relay: subprocess.Popen[str] | None = None
        self.rtt_ms = 0.0
        self.rate_mbit = 0.0
        self._made: list[str] = []
        self._closed = False

    # -- building ------------------------------------------------------------------------

    def _add_netns(self, name: str) -> None:
        netns.ip("netns", "add", name)
        self._made.append(name)
        netns.ip("-n", name, "link", "set", "lo", "up")

    def _sysctl(self, ns: str, key: str, value: str) -> None:
        r = subprocess.run(
            ["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"sysctl {key}={value} in {ns}: {r.stderr.strip()}")

    def _build(self) -> None:
        reap_stale(self.prefix)
        rt = self.router
        self._add_netns(rt)
        self._sysctl(rt, "net.ipv4.ip_forward", "1")
        for key in ("all", "default"):
            self._sysctl(rt, f"net.ipv4.conf.{key}.rp_filter", "0")
        for h in self.hosts:
            self._add_netns(h.name)
            port = f"v{h.index}"
            gw = f"{self.subnet}.{h.index + 1}.1"
            netns.ip("-n", rt, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", h.name)  # fmt: skip
            netns.ip("-n", rt, "addr", "add", f"{gw}/24", "dev", port)
            netns.ip("-n", rt, "link", "set", port, "mtu", str(self.mtu), "up")
            self._sysctl(rt, f"net.ipv4.conf.{port}.rp_filter", "0")
            netns.ip("-n", h.name, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            netns.ip("-n", h.name, "link", "set", "eth0", "mtu", str(self.mtu), "up")
            netns.ip("-n", h.name, "route", "add", "default", "via", gw)
            # Everything a host sends to another host enters the relay.
            netns.ip("-n", rt, "rule", "add", "iif", port, "table", TABLE, "pref", "100")
        # The relay creates tun0 (it owns the fd); routes to it follow once it is up.
        here = Path(__file__).resolve()
        self.relay = subprocess.Popen(
            ["ip", "netns", "exec", rt, sys.executable, str(here), "relay", "tun0", "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True,
        )  # fmt: skip
        self.procs.append(self.relay)
        assert self.relay.stdout is not None
        line = self.relay.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the delay relay did not start (said {line!r})")
        netns.ip("-n", rt, "link", "set", "tun0", "mtu", str(self.mtu), "up")
        self._sysctl(rt, "net.ipv4.conf.tun0.rp_filter", "0")
        netns.ip("-n", rt, "route", "add", "default", "dev", "tun0", "table", TABLE)

    def __enter__(self) -> DelayLan:
        _live.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- using ---------------------------------------------------------------------------

    def set_rtt(self, rtt_ms: float) -> None:
        """Hold every packet ``rtt_ms / 2`` in each direction."""
        assert self.relay is not None and self.relay.stdin is not None
        assert self.relay.stdout is not None
        self.relay.stdin.write(f"delay {rtt_ms / 2:g}\n")
        self.relay.stdin.flush()
        line = self.relay.stdout.readline().strip()
        if not line.startswith("ok"):
            raise RuntimeError(f"the delay relay did not take the delay (said {line!r})")
        self.rtt_ms = rtt_ms

    def set_rate(self, mbit: float) -> None:
        """Let each direction of each host pair carry ``mbit`` Mbit/s (0: no limit)."""
        assert self.relay is not None and self.relay.stdin is not None
        assert self.relay.stdout is not None
        self.relay.stdin.write(f"rate {mbit:g}\n")
        self.relay.stdin.flush()
        line = self.relay.stdout.readline().strip()
        if not line.startswith("ok rate"):
            raise RuntimeError(f"the delay relay did not take the rate (said {line!r})")
        self.rate_mbit = mbit

    def ping(self, src: int, dst: int, count: int = 20, interval: float = 0.05) -> Ping:
        """``ping -c count`` from host ``src`` to host ``dst``: measured RTT (ms)."""
        return self.ping_ip(src, self.hosts[dst].ip, count, interval)

    def ping_ip(self, src: int, ip: str, count: int = 20, interval: float = 0.05) -> Ping:
        """``ping -c count`` from host ``src`` to address ``ip`` (the router's own
        ``{subnet}.{src+1}.1`` answers without crossing the relay)."""
        r = self.hosts[src].run(
            ["ping", "-q", "-c", str(count), "-i", str(interval), "-W", "2", ip],
            timeout=count * (interval + 2) + 10,
        )  # fmt: skip
        m, c = _RTT_RE.search(r.stdout), _RECV_RE.search(r.stdout)
        if not c:
            raise RuntimeError(f"ping failed: {r.stdout.strip()} {r.stderr.strip()}")
        nan = float("nan")
        vals = {k: float(m[k]) for k in ("min", "avg", "max", "mdev")} if m else {}
        return Ping(
            self.rtt_ms, int(c["sent"]), int(c["recv"]),
            vals.get("min", nan), vals.get("avg", nan), vals.get("max", nan),
            vals.get("mdev", nan),
        )  # fmt: skip

    def throughput(self, src: int, dst: int, mbytes: float = 4.0, port: int = 5201) -> float:
        """Mbit/s of one TCP transfer of ``mbytes`` MB from host ``src`` to host ``dst``
        (timed by the receiver, from its first byte to its last: the link's rate, not
        its delay)."""
        recv = (
            "import socket,time,sys;s=socket.socket();"
            "s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f"s.bind(('{self.hosts[dst].ip}',{port}));s.listen(1);print('up',flush=True);"
            "c,_=s.accept();n=0;t0=0.0\n"
            "while True:\n b=c.recv(1<<20)\n if not b: break\n"
            " t0=t0 or time.perf_counter();n+=len(b)\n"
            "print(n*8/(time.perf_counter()-t0)/1e6,flush=True)"
        )
        p = self.hosts[dst].popen([sys.executable, "-c", recv], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        if p.stdout.readline().strip() != "up":
            raise RuntimeError("the receiver did not start")
        send = (
            f"import socket;c=socket.create_connection(('{self.hosts[dst].ip}',{port}));"
            f"c.sendall(bytes({int(mbytes * 1e6)}));c.close()"
        )
        self.hosts[src].run([sys.executable, "-c", send], timeout=120)
        out, _ = p.communicate(timeout=120)
        return float(out.strip())

    # -- cleanup -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process started here, then delete the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        leave()
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
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
        for name in reversed(self._made):
            netns.delete_netns(name)
        self._made.clear()


@atexit.register
def _close_all() -> None:
    for lan in list(_live):
        lan.close()


def _check(argv: Sequence[str]) -> int:
    """``python bench/_delay.py check [RTT_MS ...]``: build two hosts, ping each RTT
    (where ``ping`` is installed), then time a TCP transfer at 100 and 1000 Mbit/s and
    with no rate (``$MTU``: the links' MTU, default 1500)."""
    mtu = int(os.environ.get("MTU", "1500"))
    rtts = [float(x) for x in argv] or [0.0, 0.5, 5.0]
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))
    ok, why = available(ping=False)
    if not ok:
        print(f"cannot build the delayed LAN: {why}")
        return 1
    with DelayLan(n=2, prefix="mdlchk", mtu=mtu) as lan:
        rows = []
        for rtt in rtts if shutil.which("ping") else []:
            lan.set_rtt(rtt)
            lan.ping(0, 1, count=3)  # ARP and caches first
            rows.append(lan.ping(0, 1, count=20).row())
        widths = [max(len(r[i]) for r in [PING_HEADER, *rows]) for i in range(len(PING_HEADER))]
        for r in [PING_HEADER, *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        lan.set_rtt(0)
        for mbit in (100.0, 1000.0, 0.0):
            lan.set_rate(mbit)
            got = lan.throughput(0, 1, 4.0 if mbit else 16.0)
            print(f"rate {mbit:g} Mbit/s (0: none): a 4-16 MB TCP transfer ran {got:.0f} Mbit/s")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        sys.exit(relay_main(sys.argv[2:]))
    sys.exit(_check(sys.argv[2:] if sys.argv[1:2] == ["check"] else sys.argv[1:]))

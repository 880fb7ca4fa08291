"""Helpers the inference benchmarks share: child processes on loopback, streamed HTTP
requests timed at the client, meshd nodes and instances, its Prometheus metrics, CPU
accounting from /proc, statistics and tables.

Every child is started in its own session and registered, and every one is stopped at
exit (also on SIGTERM, which the scripts turn into SystemExit)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from meshd.transport.security import write_secret

DEFAULT_MODEL = "smollm2-135m"
#: The benchmarks place and remove models on the nodes they start, as a remote admin
#: would (the API key never could): the nodes inherit this admin key from the
#: environment, and :func:`http_client` sends it.
ADMIN_KEY = os.environ.setdefault("MESHD_ADMIN_KEY", "bench-admin-" + secrets.token_hex(16))
PROMPT = "Write a long story about a robot who learns to paint."
#: The llama_cpp.server options that match meshd's runners (n_ctx per request).
N_CTX = 4096
#: Flash attention in the baselines: as a meshd stage on the CPU runs it (off:
#: meshd.engines.attention), so a ratio compares engines, not attention kernels.
FLASH_ATTN = False
READY = re.compile(
    r"meshd ready node=(?P<id>\S+) name=(?P<name>\S+) api=(?P<api>\S+) "
    r"mesh=(?P<mesh>\d+) pub=(?P<pub>\d+)"
)
UVICORN_READY = re.compile(r"Uvicorn running on http://(?P<host>[^:]+):(?P<port>\d+)")

# -- processes ---------------------------------------------------------------------

PROCS: list[subprocess.Popen] = []


def stop_process(p: subprocess.Popen, grace: float = 8.0) -> None:
    """SIGTERM, then SIGKILL; then kill what is left of its process group (runners).

    Every child is started in its own session, so its group id is its pid and holds
    only what it started; those are killed one by one, by pid."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
    for pid in _group_members(p.pid):  # runners a killed node left behind
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ValueError):
        PROCS.remove(p)


def _group_members(pgid: int) -> list[int]:
    """Pids of the live processes in process group ``pgid`` (Linux /proc)."""
    out = []
    with contextlib.suppress(OSError):
        for d in os.listdir("/proc"):
            if d.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if int(fields[2]) == pgid and fields[0] != "Z":
                        out.append(int(d))
    return out


def stop_all() -> None:
    for p in list(PROCS):
        with contextlib.suppress(Exception):
            stop_process(p, grace=3.0)


atexit.register(stop_all)


def on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class Proc:
    """A child process whose output lines are read (and timestamped) by a thread."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        stdin: int | None = subprocess.DEVNULL,
    ) -> None:
        self.args = list(args)
        self.log_path = log_path
        self.t_start = time.perf_counter()
        self.proc = subprocess.Popen(
            self.args,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        PROCS.append(self.proc)
        self.lines: list[tuple[float, str]] = []
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for raw in self.proc.stdout:
                t = time.perf_counter()
                line = raw.decode("utf-8", "replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                with self._cv:
                    self.lines.append((t, line))
                    self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_line(self, pattern: re.Pattern[str], timeout: float) -> tuple[float, re.Match[str]]:
        """The first line matching ``pattern`` (its arrival time and match)."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cv:
            while True:
                for t, line in self.lines[seen:]:
                    m = pattern.search(line)
                    if m:
                        return t, m
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._thread.is_alive():
                    raise RuntimeError(
                        f"{self.args[:4]} exited {self.proc.returncode}:\n{self.tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.args[:4]}: no {pattern.pattern!r}:\n{self.tail()}")
                self._cv.wait(min(left, 0.5))

    def first_line(self, pattern: str) -> float | None:
        """Arrival time of the first line matching ``pattern``, if any yet."""
        rx = re.compile(pattern)
        with self._cv:
            return next((t for t, line in self.lines if rx.search(line)), None)

    def write_stdin(self, data: bytes) -> None:
        """Write to the process's stdin (opened with ``stdin=subprocess.PIPE``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def tail(self, n: int = 30) -> str:
        with self._cv:
            return "\n".join(line for _, line in self.lines[-n:])

    def stop(self) -> None:
        stop_process(self.proc)


def whole_model_env() -> dict[str, str]:
    """The environment meshd gives a runner that holds a whole model alone on its node
    (``GOMP_SPINCOUNT``: ``meshd.engines.threads.runner_spincount``): what every
    subject that holds a whole model on this machine gets, so all use the same OpenMP
    behaviour."""
    from meshd.engines.threads import runner_env, runner_spincount

    return runner_env(spincount=runner_spincount(n_stages=1, n_runners=1))


class WorkerProc:
    """The calling script run again as ``--worker``: one process holding the model
    in llama-cpp-python, answering one JSON line per command on stdin.

    It gets a whole-model runner's environment (:func:`whole_model_env`), so both
    sides use the same OpenMP behaviour. Its first line (``info``) says it is ready.
    """

    def __init__(self, script: str, tmp: Path, args: list[str], quit_line: str) -> None:
        with open(tmp / "direct.log", "wb") as err:
            self.p = subprocess.Popen(
                [sys.executable, str(Path(script).resolve()), "--worker", *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env=whole_model_env(), start_new_session=True, text=True,
            )  # fmt: skip
        PROCS.append(self.p)
        self.quit_line = quit_line
        self.info: Any = self.read()

    def read(self) -> Any:
        """The worker's next JSON line."""
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"direct worker exited {self.p.wait()}")
        return json.loads(line)

    def ask(self, line: str) -> Any:
        """Send one command line and return the answer."""
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.p.stdin is not None
            self.p.stdin.write(self.quit_line + "\n")
            self.p.stdin.flush()
            self.p.wait(5)
        stop_process(self.p)


def add_worker_args(p: Any) -> None:
    """The hidden options a script's ``--worker`` mode reads."""
    import argparse

    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-model", help=argparse.SUPPRESS)
    p.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)


def run_measure(prefix: str, keep_logs: bool, measure: Callable[[Path], int]) -> int:
    """Run ``measure(tmp)`` in a fresh temporary dir; a benchmark reports, it does not
    fail: an error is printed and the exit code stays 0. Every child is stopped."""
    signal.signal(signal.SIGTERM, on_sigterm)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        return measure(tmp)
    except Exception as e:
        print(f"benchmark stopped: {type(e).__name__}: {e}", file=sys.stderr)
        return 0
    finally:
        stop_all()
        if keep_logs:
            print(f"logs in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def meshd_command() -> list[str]:
    """``meshd`` as a user runs it (the console script), else ``python -m``."""
    exe = shutil.which("meshd")
    return [exe] if exe else [sys.executable, "-m", "meshd.cli.meshd"]


@dataclass
class Node:
    name: str
    proc: Proc
    api: str
    mesh_port: int


def start_node(
    tmp: Path,
    name: str,
    cluster: str,
    peers: Sequence[Node] = (),
    timeout: float = 60.0,
    extra: Sequence[str] = (),
    cpus: str = "",
) -> Node:
    """``meshd up --no-model`` on loopback, OS-chosen ports; wait for its ready line.

    The nodes of one ``cluster`` share a secret file in ``tmp`` (made on first use), so
    they are members at once, as a secured household's nodes are after approval.
    ``cpus`` (``taskset -c`` syntax: ``"0"``, ``"2-3"``) pins the node and the runners
    it starts, so that nodes on one machine act as machines of their own.
    """
    secret = tmp / f"{cluster}.secret"
    if not secret.exists():
        write_secret(secret)
    args = [
        *meshd_command(), "up", "--name", name, "--cluster", cluster, "--no-model",
        "--no-discovery", "--api-port", "0", "--mesh-port", "0", "--mesh-host", "127.0.0.1",
        "--data-dir", str(tmp / f"data-{name}"), "--secret-file", str(secret), *extra,
    ]  # fmt: skip
    for p in peers:
        args += ["--peer", f"127.0.0.1:{p.mesh_port}"]
    if cpus:
        args = ["taskset", "-c", cpus, *args]
    proc = Proc(args, tmp / f"node-{name}.log")
    _, m = proc.wait_line(READY, timeout)
    return Node(name, proc, m["api"], int(m["mesh"]))


# -- HTTP ----------------------------------------------------------------------------


def http_client(timeout: float = 120.0) -> httpx.Client:
    # trust_env=False: a proxy from the environment must never sit on loopback.
    return httpx.Client(
        timeout=httpx.Timeout(timeout, connect=5.0),
        trust_env=False,
        headers={"x-meshd-admin": ADMIN_KEY},
    )


@dataclass
class Stream:
    """One streamed request as the client saw it (perf_counter times)."""

    t_sent: float
    t_first: float
    t_last: float
    t_end: float
    tokens: int
    events: int

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first / time from the first token to the last."""
        dt = self.t_last - self.t_first
        return (self.tokens - 1) / dt if self.tokens > 1 and dt > 0 else float("nan")

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_sent


class HttpError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


def stream_chat(client: httpx.Client, base: str, payload: dict[str, Any]) -> Stream:
    """POST a streaming chat completion; time its content events.

    Tokens are the usage's ``completion_tokens`` when the server sends it (meshd),
    else the number of content events (llama_cpp.server sends one per token)."""
    t_sent = time.perf_counter()
    t_first = t_last = 0.0
    events = 0
    usage: int | None = None
    with client.stream("POST", base + "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            raise HttpError(r.status_code, r.read().decode("utf-8", "replace"))
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            for ch in obj.get("choices") or ():
                if (ch.get("delta") or {}).get("content"):
                    events += 1
                    if not t_first:
                        t_first = now
                    t_last = now
                elif ch.get("finish_reason") and t_first:
                    t_last = now  # the last token may carry no text of its own
            if obj.get("usage"):
                usage = int(obj["usage"]["completion_tokens"])
    t_end = time.perf_counter()
    if not t_first:
        raise RuntimeError("the stream carried no content")
    return Stream(t_sent, t_first, t_last, t_end, usage if usage is not None else events, events)


def chat_payload(
    model: str, tokens: int, *, meshd: bool, messages: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    """A streamed greedy chat request for ``tokens`` tokens (``PROMPT`` unless
    ``messages``): meshd's ``ignore_eos``, else ``min_tokens`` (llama_cpp.server)."""
    p: dict[str, Any] = {
        "model": model,
        "messages": messages or [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
    }
    if meshd:
        p["ignore_eos"] = True
        p["stream_options"] = {"include_usage": True}
    else:
        # llama_cpp.server has no ignore_eos; min_tokens masks EOS until max_tokens.
        p["min_tokens"] = tokens
    return p


@dataclass
class Concurrent:
    streams: list[Stream]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def wall(self) -> float:
        return max(s.t_end for s in self.streams) - min(s.t_sent for s in self.streams)

    @property
    def agg_tok_s(self) -> float:
        """Every stream's tokens / wall time from the first request sent to the last end."""
        return self.tokens / self.wall


def run_concurrent(
    base: str, payload: dict[str, Any] | Sequence[dict[str, Any]], n: int
) -> Concurrent:
    """``n`` streams at once (one connection each), started together; stream ``i``
    sends ``payload[i]`` when given one payload per stream."""
    payloads = [payload] * n if isinstance(payload, dict) else list(payload)
    barrier = threading.Barrier(n)
    out: list[Stream | BaseException | None] = [None] * n

    def one(i: int) -> None:
        try:
            with http_client() as c:
                barrier.wait(30)
                out[i] = stream_chat(c, base, payloads[i])
        except BaseException as e:  # reported below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [e for e in out if isinstance(e, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed: {errors[0]}")
    return Concurrent([s for s in out if isinstance(s, Stream)])


def wait_instance_ready(client: httpx.Client, node: Node, iid: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(f"{node.api}/v1/instances/{iid}")
        r.raise_for_status()
        stages = r.json()["stages"]
        if all(s["state"] == "ready" for s in stages):
            return
        failed = [s for s in stages if s["state"] == "failed"]
        if failed:
            raise RuntimeError(f"instance {iid}: stage failed: {failed[0].get('reason')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"instance {iid} not ready: {stages}")
        time.sleep(0.1)


def place(
    client: httpx.Client,
    node: Node,
    model: str,
    nodes: list[str],
    timeout: float = 120.0,
    **extra: object,
) -> str:
    """Place ``model`` on ``nodes`` (a stage each; ``extra``: more fields of the body)
    and wait until it serves. Raises when it ends on other nodes than asked: a stage
    given up and repaired elsewhere (a busy machine's late heartbeats, a model a node
    cannot fetch) would time another layout than the one the bench names."""
    r = client.post(f"{node.api}/v1/instances", json={"model": model, "nodes": nodes, **extra})
    if r.status_code >= 300:
        raise HttpError(r.status_code, r.text)
    iid = r.json()["id"]
    wait_instance_ready(client, node, iid, timeout)
    stages = client.get(f"{node.api}/v1/instances/{iid}").json()["stages"]
    if len(stages) != len(nodes):
        raise RuntimeError(f"asked for {len(nodes)} stage(s) on {nodes}, got {stages}")
    return iid


def wait_live(client: httpx.Client, node: Node, names: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        nodes = client.get(f"{node.api}/v1/cluster").json()["nodes"]
        live = {n["name"] for n in nodes if n.get("liveness") == "alive"}
        if names <= live:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes {names - live} not alive in {node.name}'s view")
        time.sleep(0.1)


# -- meshd's own metrics (where time goes) -------------------------------------------

_METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def scrape(client: httpx.Client, node: Node) -> dict[tuple[str, frozenset], float]:
    """Prometheus text from ``/metrics`` as {(name, labels): value} (empty if none)."""
    try:
        r = client.get(node.api + "/metrics", timeout=5.0)
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    out: dict[tuple[str, frozenset], float] = {}
    for line in r.text.splitlines():
        m = _METRIC.match(line)
        if not m or line.startswith("#"):
            continue
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m["labels"] or ""))
        with contextlib.suppress(ValueError):
            out[(m["name"], labels)] = float(m["value"])
    return out


def counted(before: dict, after: dict, name: str, **labels: str) -> float:
    """How much counter ``name`` grew between two scrapes, over every label set that
    has ``labels``."""
    want = set(labels.items())
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name and want <= k[1])


def metric_delta(before: dict, after: dict, name: str, **labels: str) -> tuple[float, float] | None:
    """(sum, count) of histogram ``name`` between two scrapes, for matching labels."""
    want = set(labels.items())
    s = c = 0.0
    found = False
    for (n, ls), v in after.items():
        if want <= ls and n in (name + "_sum", name + "_count"):
            found = True
            d = v - before.get((n, ls), 0.0)
            if n.endswith("_sum"):
                s += d
            else:
                c += d
    return (s, c) if found and c > 0 else None


@dataclass
class MetricSeries:
    """Per-repeat means of histograms (one request's sum / count each)."""

    means: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, sc: tuple[float, float] | None) -> None:
        if sc is not None and sc[1]:
            self.means.setdefault(key, []).append(sc[0] / sc[1])

    def mean_ms(self, key: str) -> float | None:
        """Median over repeats of the per-request mean, in ms."""
        xs = self.means.get(key)
        return 1000 * med(xs) if xs else None


def start_llama_server(
    tmp: Path,
    model_path: str,
    threads: int,
    *,
    launcher: Sequence[str] | None = None,
    extra: Sequence[str] = (),
    name: str = "llama-server",
    env: dict[str, str] | None = None,
) -> tuple[Proc, str]:
    """``python -m llama_cpp.server`` on loopback, an OS-chosen port, same settings
    (``launcher`` replaces ``python -m llama_cpp.server``; ``extra`` options follow;
    ``env``, :func:`whole_model_env` unless given).

    ``--interrupt_requests False``: by default it cuts the stream in progress whenever
    another request arrives, which would end 7 of 8 concurrent streams early."""
    args = [
        *(launcher or [sys.executable, "-m", "llama_cpp.server"]), "--model", model_path,
        "--n_ctx", str(N_CTX), "--n_threads", str(threads), "--n_threads_batch", str(threads),
        "--flash_attn", str(FLASH_ATTN), "--host", "127.0.0.1", "--port", "0",
        "--interrupt_requests", "False", "--verbose", "False", *extra,
    ]  # fmt: skip
    proc = Proc(args, tmp / f"{name}.log", env=whole_model_env() if env is None else env)
    _, m = proc.wait_line(UVICORN_READY, 120.0)
    return proc, f"http://{m['host']}:{m['port']}"


def llama_server_missing() -> str | None:
    """Why llama_cpp.server cannot run here (None when it can)."""
    import importlib.util

    missing = [
        m
        for m in ("fastapi", "sse_starlette", "starlette_context", "pydantic_settings", "uvicorn")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        return f"llama_cpp.server needs {', '.join(missing)} (pip install them by name)"
    return None


# -- statistics and output ---------------------------------------------------------------


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float], fmt: str = "{:.3f}") -> str:
    if not xs:
        return "-"
    return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"


@dataclass
class Series:
    """Raw samples of one measured quantity, in repeat order."""

    label: str
    unit: str = "tok/s"
    xs: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class Figure:
    name: str
    ratios: list[float]
    goal: str
    met: Callable[[float], bool]
    fmt: str = "{:.3f}"
    note: str = ""

    def row(self) -> list[str]:
        if not self.ratios:
            return [self.name, "-", "-", self.goal, "not measured", self.note]
        v = med(self.ratios)
        return [
            self.name,
            self.fmt.format(v),
            spread(self.ratios, self.fmt),
            self.goal,
            "met" if self.met(v) else "NOT met",
            self.note,
        ]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)

    def fmt(r: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()

    return "\n".join([fmt(header), line, *(fmt(r) for r in rows)])


def print_pair(headline: str, series: Sequence[Series], what: str, fmt: str, fig: Figure) -> None:
    """The closing report of a two-sided benchmark: a headline, each side's median and
    spread in ``fmt``, then the figure."""
    print()
    print(headline)
    rows = [[s.label, fmt.format(med(s.xs)), spread(s.xs, fmt)] for s in series]
    print(table(rows, [what, f"{series[0].unit} (median)", "min-max"]))
    print()
    print(table([fig.row()], ["figure", "median", "min-max", "goal", "", "note"]))


def paired(a: Series, b: Series) -> list[float]:
    """a[i] / b[i] for the repeats where both were measured."""
    return [x / y for x, y in zip(a.xs, b.xs, strict=False) if y and y == y and x == x]


def cpu_busy(seconds: float = 1.0) -> float:
    """Share of all CPUs busy over ``seconds`` (from /proc/stat), or NaN."""

    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v), idle

    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
        return 1.0 - (i1 - i0) / max(1, t1 - t0)
    except OSError:
        return float("nan")


class OthersMeter:
    """CPU used by processes outside this one and its descendants, as a share of all
    CPUs, over an interval (Linux /proc; NaN elsewhere). On a shared machine it tells a
    measurement that ran alone from one that shared the cores with someone's tests."""

    def __init__(self) -> None:
        self.t0 = self._snap()

    @staticmethod
    def _snap() -> tuple[int, int, int] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            idle = v[3] + (v[4] if len(v) > 4 else 0)
            busy = sum(v[:8]) - idle  # guest time is already in user
            return sum(v[:8]), busy, _tree_ticks(os.getpid())
        except (OSError, ValueError, IndexError):
            return None

    def share(self) -> float:
        t1 = self._snap()
        if self.t0 is None or t1 is None or t1[0] <= self.t0[0]:
            return float("nan")
        others = (t1[1] - self.t0[1]) - (t1[2] - self.t0[2])
        return max(0.0, others / (t1[0] - self.t0[0]))


def _tree_ticks(root: int) -> int:
    """utime + stime (clock ticks, every thread) of ``root`` and its live descendants."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parent[int(d)] = int(fields[1])
            ticks[int(d)] = int(fields[11]) + int(fields[12])
    mine = {root}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grew = True
    return sum(ticks.get(p, 0) for p in mine)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_ns(pids: Sequence[int]) -> int:
    """CPU time (ns, every thread) the processes ``pids`` have used so far (Linux)."""
    total = 0
    for pid in pids:
        if pid == os.getpid():
            total += time.process_time_ns()  # counts threads that have ended, too
            continue
        with contextlib.suppress(OSError, ValueError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
    return total


def preemptions(pids: Sequence[int]) -> int:
    """Involuntary context switches of every thread of ``pids`` so far (Linux)."""
    total = 0
    for pid in pids:
        if pid == os.getpid():
            import resource

            total += resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
            continue
        with contextlib.suppress(OSError, ValueError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/status") as f:
                    for line in f:
                        if line.startswith("nonvoluntary_ctxt_switches"):
                            total += int(line.split()[1])
    return total


def runner_pids(node_pid: int, instance: str) -> dict[int, int]:
    """Stage -> pid of the runners of ``instance`` that ``node_pid`` started."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != node_pid:
                    continue
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                if b"meshd.engines.runner" not in cmd:
                    continue
                # argv: ... -m meshd.engines.runner INSTANCE STAGE (the config is on stdin)
                at = cmd.index(b"meshd.engines.runner")
                if cmd[at + 1].decode() == instance:
                    out[int(cmd[at + 2])] = int(d)
    return out


class CpuMeter:
    """CPU ms and preemptions per generated token, per named process group; one sample
    per run, reported as the median over runs."""

    def __init__(self) -> None:
        self.cpu: dict[str, list[float]] = {}
        self.pre: dict[str, list[float]] = {}
        self.wall: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def run(self, scope: str, groups: dict[str, Sequence[int]]):
        """Measure the body; it hands its token count back through ``box[0]``."""
        start = {g: (cpu_ns(p), preemptions(p)) for g, p in groups.items()}
        t0 = time.perf_counter()
        box: list[int] = [0]
        yield box
        wall = time.perf_counter() - t0
        n = box[0]
        if n <= 0:
            return
        for g, p in groups.items():
            key = f"{scope}|{g}"
            self.cpu.setdefault(key, []).append((cpu_ns(p) - start[g][0]) / 1e6 / n)
            self.pre.setdefault(key, []).append((preemptions(p) - start[g][1]) / n)
        self.wall.setdefault(scope, []).append(1000 * wall / n)

    def ms(self, scope: str, group: str) -> float | None:
        xs = self.cpu.get(f"{scope}|{group}")
        return med(xs) if xs else None

    def preempted(self, scope: str, group: str) -> float | None:
        xs = self.pre.get(f"{scope}|{group}")
        return med(xs) if xs else None

    def groups(self, scope: str) -> list[str]:
        return [k.split("|", 1)[1] for k in self.cpu if k.startswith(scope + "|")]

    def wall_ms(self, scope: str) -> float | None:
        xs = self.wall.get(scope)
        return med(xs) if xs else None

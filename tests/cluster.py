"""Test harness: real `meshd up` processes on loopback, with cleanup guaranteed."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshd.api.app import ROUTES
from meshd.api.auth import ADMIN_HEADER, Access, access_of
from meshd.node.cluster_store import KEY_FILE, STATE_FILE, ClusterStore
from meshd.transport.security import write_secret

#: The tests play the owner of every node they start: each node takes this admin key
#: ($MESHD_ADMIN_KEY: set for the nodes Cluster starts, and by tests/conftest.py for
#: every process, so meshctl sends it too), and the test process's requests to an
#: admin route carry it (:func:`act_as_owner`). Tests of the credentials themselves say
#: what they send, or run as another user (tests/api/test_access.py).
ADMIN_KEY = "tests-admin-" + secrets.token_hex(16)
ADMIN = {ADMIN_HEADER: ADMIN_KEY}
_stranger = False

_READY = re.compile(
    r"meshd ready node=(?P<id>\S+) name=(?P<name>\S+) api=(?P<api>\S+) "
    r"mesh=(?P<mesh>\d+) pub=(?P<pub>\d+)"
)
_LIVE: set[subprocess.Popen] = set()

#: The context (``--context``) of the models a test node places: each runner clears KV
#: for 8 requests of it at start, 1.5 GB and ~1 s of CPU at the default model's 8192
#: tokens against 0.2 GB and 0.5 s to load the whole model at 1024 (0.8 s at 2048), and
#: no test but tests/node/test_context.py (which says None: placement's memory-chosen
#: default) fills more.
TEST_CONTEXT = 1024


def _kill_all() -> None:
    for p in list(_LIVE):
        with contextlib.suppress(Exception):
            p.kill()
            p.wait(5)


atexit.register(_kill_all)


@dataclass
class NodeProc:
    """One running `meshd up` process."""

    name: str
    data_dir: Path
    args: list[str]
    proc: subprocess.Popen
    log_path: Path
    node_id: str = ""
    api: str = ""
    mesh_port: int = 0
    pub_port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def get(self, path: str, timeout: float = 2.0) -> Any:
        """GET a JSON route of this node's API."""
        r = httpx.get(self.api + path, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def cluster(self) -> dict[str, Any]:
        """The node's /v1/cluster body."""
        return self.get("/v1/cluster")

    def liveness(self) -> dict[str, str]:
        """Node name -> liveness as this node sees it."""
        return {n["name"]: n["liveness"] for n in self.cluster()["nodes"]}

    def log(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, no goodbye."""
        self.proc.kill()
        self.proc.wait(10)
        _LIVE.discard(self.proc)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait for a clean exit; return the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            _LIVE.discard(self.proc)


class Cluster:
    """Starts meshd nodes on loopback with OS-chosen ports; stops them all on exit."""

    def __init__(self, tmp: Path, cluster: str = "test", discovery: bool = False) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.cluster_name = f"{cluster}-{os.getpid()}-{time.monotonic_ns()}"
        self.discovery = discovery
        self.nodes: list[NodeProc] = []
        #: The cluster's secret: every node of the test cluster starts with it (the
        #: automation path: members at once, no approval), unless a test says how its
        #: node gets in (--secret-file, --join, --open).
        self.secret_file = tmp / "cluster.secret"
        if not self.secret_file.exists():
            write_secret(self.secret_file)

    def start(
        self,
        name: str,
        peers: list[NodeProc] | None = None,
        mesh_port: int = 0,
        data_dir: Path | None = None,
        extra_args: list[str] | None = None,
        wait: bool = True,
        timeout: float = 30.0,
        model: str | None = None,
        env: dict[str, str] | None = None,
        secret: bool = True,
        ctrl_c: bool = False,
        context: int | None = TEST_CONTEXT,
    ) -> NodeProc:
        """Start `meshd up --name NAME` seeded with ``peers``; wait for its ready line.

        ``model``: what `meshd up` should make the cluster serve (default: nothing, so
        control-plane tests load no weights). ``env``: variables added to this process's
        environment for the node. ``secret``: False starts it as a user would, with no
        way in but approval (or what ``extra_args`` say). ``ctrl_c``: the node takes
        SIGINT as at a terminal, even where this process was started ignoring it (a
        background job of a script: its children inherit the ignoring). ``context``: the
        node's ``--context`` (:data:`TEST_CONTEXT`; None: placement's default)."""
        data_dir = data_dir or self.tmp / name
        args = [
            sys.executable, "-m", "meshd.cli.meshd", "up",
            "--name", name,
            "--cluster", self.cluster_name,
            "--api-port", "0",
            "--mesh-host", "127.0.0.1",
            "--mesh-port", str(mesh_port),
            "--data-dir", str(data_dir),
        ]  # fmt: skip
        if not self.discovery:
            args.append("--no-discovery")
        args += ["--no-model"] if model is None else ["--model", model]
        for p in peers or []:
            args += ["--peer", f"127.0.0.1:{p.mesh_port}"]
        if context is not None:
            args += ["--context", str(context)]
        # A test node keeps its instances loaded (a slow CI leaves gaps longer than the
        # default 5 minutes between a package's requests); a request's keep_alive still
        # unloads one (tests/api/test_ollama.py).
        args.append("--keep-alive=-1")
        extra = list(extra_args or [])
        if secret and not {"--secret-file", "--join", "--open"} & set(extra):
            args += ["--secret-file", str(self.secret_file)]
            self._seed_secret(data_dir)
        _seed_cache(data_dir)
        args += extra
        log_path = self.tmp / f"{name}-{len(self.nodes)}.log"
        f = open(log_path, "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            args, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "MESHD_ADMIN_KEY": ADMIN_KEY, **(env or {})},
            preexec_fn=_default_sigint if ctrl_c else None,
        )  # fmt: skip
        _LIVE.add(proc)
        n = NodeProc(name, data_dir, args, proc, log_path)
        self.nodes.append(n)
        if wait:
            self.wait_ready(n, timeout)
        return n

    def _seed_secret(self, data_dir: Path) -> None:
        """Give a new data dir the cluster files a node writes from the secret at its
        first start (derived once a cluster, here, as a node keeps them across its
        restarts). The derivation is Argon2, slow on purpose: 0.6 s of CPU for each of
        the suite's hundreds of nodes. Tests that pass their own ``--secret-file``
        (tests/node/test_security.py, test_partition.py, cli/test_doctor.py) and
        tests/node/test_data_dir.py still see a node derive it."""
        if (data_dir / STATE_FILE).exists():
            return
        seed = self.tmp / ".secret-seed"
        if not (seed / STATE_FILE).exists():
            ClusterStore(seed).from_secret(self.secret_file.read_text(), self.cluster_name)
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in (KEY_FILE, STATE_FILE):
            shutil.copy2(seed / name, data_dir / name)

    def wait_ready(self, n: NodeProc, timeout: float = 30.0) -> NodeProc:
        """Block until the node printed its ready line (or fail with its log)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _READY.search(n.log())
            if m:
                n.node_id, n.api = m["id"], m["api"]
                n.mesh_port, n.pub_port = int(m["mesh"]), int(m["pub"])
                return n
            if n.proc.poll() is not None:
                raise RuntimeError(f"{n.name} exited {n.proc.returncode}:\n{n.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"{n.name} not ready in {timeout}s:\n{n.log()}")

    def restart(self, n: NodeProc, timeout: float = 30.0) -> NodeProc:
        """Start a stopped node again with the same data dir and mesh port."""
        assert not n.alive()
        return self.start(
            n.name, data_dir=n.data_dir, mesh_port=n.mesh_port, timeout=timeout,
            extra_args=list(_peer_args(n.args)) + list(_access_args(n.args)),
            model=_model_arg(n.args), context=_context_arg(n.args),
        )  # fmt: skip

    def close(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL)."""
        for n in self.nodes:
            if n.alive():
                n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for n in self.nodes:
            try:
                n.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait(5)
            _LIVE.discard(n.proc)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _model_arg(args: list[str]) -> str | None:
    return args[args.index("--model") + 1] if "--model" in args else None


def _context_arg(args: list[str]) -> int | None:
    return int(args[args.index("--context") + 1]) if "--context" in args else None


def _access_args(args: list[str]) -> Iterator[str]:
    """How the node got in: ``--open``, or ``--secret-file PATH`` (a code is one use)."""
    if "--open" in args:
        yield "--open"
    if "--secret-file" in args:
        yield "--secret-file"
        yield args[args.index("--secret-file") + 1]


def _peer_args(args: list[str]) -> Iterator[str]:
    it = iter(args)
    for a in it:
        if a == "--peer":
            yield a
            yield next(it)


_CACHE_SEED: list[Path] = []


def _seed_cache(data_dir: Path) -> None:
    """Give a new data dir the cache a node fills at its first start on a machine: the
    default model's sha256 (0.35 s of CPU a node) and facts, and the backend probe's
    answer (a subprocess of 0.35 s before the node is up). Every test node starts on a
    fresh data dir, as no household node does twice; tests of the probe, hashing and
    facts themselves call them on empty directories."""
    cache = data_dir / "cache"
    if cache.exists():
        return
    if not _CACHE_SEED:
        import asyncio

        from meshd.engines.probe import probe
        from meshd.models.facts import read_resolved_facts
        from meshd.models.resolve import DEFAULT_MODEL, resolve_model

        seed = Path(tempfile.mkdtemp(prefix="meshd-cache-seed-"))
        read_resolved_facts(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL, seed)
        asyncio.run(probe(cache_dir=seed))
        _CACHE_SEED.append(seed)
    shutil.copytree(_CACHE_SEED[0], cache)


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy; return it or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except (httpx.HTTPError, KeyError) as e:
            last_exc = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met in {timeout}s (last error: {last_exc})")
        time.sleep(interval)


def wait_serving(n: NodeProc, instance_id: str, timeout: float = 120.0) -> dict:
    """Wait until every stage of the instance is ready, as ``n`` sees it; its view."""
    path = f"/v1/instances/{instance_id}"
    wait_for(lambda: all(s["state"] == "ready" for s in n.get(path)["stages"]), timeout, 0.1)
    return n.get(path)


def metric_total(n: NodeProc, name: str) -> float:
    """The sum of every sample of the Prometheus metric ``name`` on ``n``'s /metrics."""
    text = httpx.get(n.api + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))  # fmt: skip


def _owner_header(request: httpx.Request) -> None:
    """Add :data:`ADMIN` to a request for an admin route that names no admin credential."""
    if _stranger or ADMIN_HEADER in request.headers:
        return
    scope = {"type": "http", "method": request.method, "path": request.url.path, "root_path": ""}
    if access_of(ROUTES, scope) is Access.ADMIN:
        request.headers[ADMIN_HEADER] = ADMIN_KEY


def act_as_owner() -> None:
    """From now on, this process's httpx requests to an admin route of any node carry
    :data:`ADMIN_KEY`, as the owner's meshctl would carry its credential: the tests that
    place models, invite or approve call the API as its owner, the one place saying so.
    The header is added at the transport, so every client (openai's, anthropic's) gets
    it; a request that sends its own ``x-meshd-admin`` keeps it."""
    sync, asyncs = httpx.HTTPTransport.handle_request, httpx.AsyncHTTPTransport.handle_async_request

    def handle(self: httpx.HTTPTransport, request: httpx.Request) -> httpx.Response:
        _owner_header(request)
        return sync(self, request)

    async def handle_async(
        self: httpx.AsyncHTTPTransport, request: httpx.Request
    ) -> httpx.Response:
        _owner_header(request)
        return await asyncs(self, request)

    httpx.HTTPTransport.handle_request = handle  # type: ignore[method-assign]
    httpx.AsyncHTTPTransport.handle_async_request = handle_async  # type: ignore[method-assign]


def share_tls_context() -> None:
    """From now on, this process's httpx clients share one default TLS context.

    ``httpx.get`` builds a client, and every client built its own context, loading the
    CA bundle: 40 ms of CPU a call. The tests poll their nodes' APIs thousands of times
    (plain HTTP on loopback, no TLS at all), so that load was a large part of the
    suite's CPU, taken from the nodes being waited on."""
    import httpx._transports.default as transports

    build = transports.create_ssl_context
    shared: dict[tuple[object, ...], Any] = {}

    def create(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return build(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in shared:
            shared[key] = build(verify=verify, cert=cert, trust_env=trust_env)
        return shared[key]

    transports.create_ssl_context = create  # type: ignore[assignment]


@contextlib.contextmanager
def as_stranger() -> Iterator[None]:
    """Requests made inside carry no admin credential of :func:`act_as_owner`'s."""
    global _stranger
    _stranger = True
    try:
        yield
    finally:
        _stranger = False

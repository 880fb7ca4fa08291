"""Real runner processes for tests: ``python -m meshd.engines.runner`` and an API side.

:class:`RunnerProcess` starts a runner exactly as the node's supervisor does (the config
then control lines on stdin, status lines on stdout, a minimal environment) and keeps
its status events. :class:`ApiSide` plays the API node over real ZeroMQ sockets: a
ROUTER the runners send DataChunks to, and DEALERs to send them Generate / Release.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from meshd.domain.job import Job
from meshd.engines.protocol import RunnerConfig, runner_command
from meshd.engines.threads import runner_env
from meshd.transport import wire
from tests.conftest import MODEL_SHA256

#: Layers of the default model.
N_LAYERS = 30


def runner_config(
    model_path: Path,
    cache_dir: Path,
    *,
    stage: int = 0,
    bounds: list[tuple[int, int]] | None = None,
    instance: str = "test",
    generation: int = 1,
    **kw: object,
) -> RunnerConfig:
    """Config of stage ``stage`` of a plan over ``bounds`` (default: one whole stage)."""
    bounds = bounds or [(0, N_LAYERS)]
    start, end = bounds[stage]
    return RunnerConfig(
        instance=instance, generation=generation, stage=stage, n_stages=len(bounds),
        model_path=str(model_path), start=start, end=end,
        cache_dir=str(cache_dir), bind_host="127.0.0.1",
        **{"n_ctx": 1024, "sha256": MODEL_SHA256, "n_layers": N_LAYERS, **kw},  # type: ignore[arg-type]
    )  # fmt: skip


class RunnerProcess:
    """One runner subprocess, in its own session so signals sent to the test's
    process group never reach it."""

    def __init__(
        self, cfg: RunnerConfig, log_dir: Path, timeout: float = 120.0, then: Sequence[dict] = ()
    ) -> None:
        """``then``: control lines written together with the config, in one write (the
        node may send a command before the runner has read its config)."""
        self.cfg = cfg
        env = {**runner_env(minimal=True), "MESHD_THREADS": "1"}
        self.log = log_dir / f"runner-{cfg.instance}-{cfg.stage}-{time.monotonic_ns()}.log"
        argv, config_line = runner_command(cfg)
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env=env, start_new_session=True,
            )  # fmt: skip
        assert self.proc.stdin is not None
        self.proc.stdin.write(config_line.decode() + "".join(json.dumps(c) + "\n" for c in then))
        self.proc.stdin.flush()
        self.events: list[dict] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.wait_event(lambda e: e["event"] == "listening", timeout)["port"])
        ev = self.wait_event(lambda e: e["event"] in ("ready", "failed"), timeout)
        if ev["event"] == "failed":
            raise RuntimeError(f"runner failed: {ev.get('reason')}; see {self.log}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()
        with self._cond:
            self.events.append({"event": "exit"})
            self._cond.notify_all()

    @property
    def addr(self) -> wire.Addr:
        """Where this runner listens."""
        return wire.Addr(node="runner", addresses=["127.0.0.1"], port=self.port)

    def wait_event(self, match: Callable[[dict], bool], timeout: float) -> dict:
        """The first status event (from the start) that ``match`` accepts."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev in self.events:
                    if match(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching runner event in {timeout} s: {self.events}")
                self._cond.wait(left)

    def active(self) -> int:
        """Requests holding KV on this runner, as it last reported."""
        with self._cond:
            return self.active_unlocked()

    def wait_active(self, n: int, timeout: float) -> None:
        """Wait until the runner reports ``n`` requests holding KV (status lines come
        on stdout, a moment after the chunks)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.active_unlocked() != n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"runner reports {self.active_unlocked()} active, not {n}")
                self._cond.wait(left)

    def active_unlocked(self) -> int:
        """:meth:`active`, the caller holding the lock."""
        loads = [e["active"] for e in self.events if e["event"] == "load"]
        return loads[-1] if loads else 0

    def load(self) -> dict:
        """The runner's last ``load`` status event (``{}``: none yet)."""
        with self._cond:
            return next((e for e in reversed(self.events) if e["event"] == "load"), {})

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stopped (SIGSTOP) inside the block, as a runner the kernel has not scheduled:
        what is sent to it meanwhile waits in its socket, and it reads it all at once."""
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def wait_unread(self, n_bytes: int, timeout: float) -> bool:
        """Wait until at least ``n_bytes`` wait unread in the kernel on the connections
        to this runner's port (``/proc/net/tcp``'s rx_queue): sent, not yet taken.
        False after ``timeout``: the sender holds them (a link being redialled, whose
        handshake waits for this runner), and sends them together once it is up."""
        deadline = time.monotonic() + timeout
        while _unread(self.port) < n_bytes:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)  # a kernel counter: nothing to wait on but the clock
        return True

    def control(self, cmd: dict) -> None:
        """Send one control line, as the supervisor does."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM would."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """Close stdin (the node is gone), then make sure it exits."""
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()


def _unread(port: int) -> int:
    """Bytes that wait unread on the established TCP connections to local ``port``."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                local, state, queues = cols[1], cols[3], cols[4]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    total += int(queues.split(":")[1], 16)
    return total


def _connect(sock: zmq.Socket, endpoint: str, timeout: float = 10.0) -> None:
    """Connects ``sock`` and waits until the link is up: a message queued on a link
    still connecting may reach its runner after one sent later to another runner
    (ci38: a cancel sent to stage 1 first came after the request's activations)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
    try:
        sock.connect(endpoint)
        if not monitor.poll(timeout * 1000):
            raise TimeoutError(f"no connection to {endpoint} in {timeout} s")
        recv_monitor_message(monitor)
    finally:
        sock.disable_monitor()
        monitor.close(0)


class ApiSide:
    """The API node's sockets: a ROUTER that receives DataChunks, DEALERs to runners."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self._dealers: dict[int, zmq.Socket] = {}
        #: Every chunk received, by request id, in arrival order; and all of them.
        self.chunks: dict[str, list[wire.DataChunk]] = {}
        self.arrived: list[wire.DataChunk] = []
        #: Messages received (a DataChunks batch counts once).
        self.received = 0

    @property
    def reply_to(self) -> wire.Addr:
        """Where runners send this side's chunks."""
        return wire.Addr(node="api", addresses=["127.0.0.1"], port=self.port)

    def send(self, to: RunnerProcess | wire.Addr, msg: wire.Message) -> int:
        """Send ``msg`` to a runner; its encoded size."""
        addr = to.addr if isinstance(to, RunnerProcess) else to
        d = self._dealers.get(addr.port)
        if d is None:
            d = self._dealers[addr.port] = self.ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            _connect(d, f"tcp://127.0.0.1:{addr.port}")
        data = wire.encode(msg)
        d.send(data)
        return len(data)

    def generate(self, route: list[RunnerProcess], req: str, **kw: object) -> int:
        """Send a ``Generate`` for ``req`` to the first runner of ``route``; its size."""
        return self.send(
            route[0],
            wire.Generate(
                req=req, instance=route[0].cfg.instance, generation=route[0].cfg.generation,
                route=[r.addr for r in route], reply_to=self.reply_to,
                resume_tokens=kw.pop("resume_tokens", []), job=Job(**kw),
            ),
        )  # fmt: skip

    def cancel(self, to: RunnerProcess, req: str) -> None:
        """``Release(cancel)`` for ``req``, as the API node sends when a client leaves."""
        self.send(to, wire.Release(req=req, instance=to.cfg.instance, reason="cancel"))

    def pump(self, timeout: float) -> None:
        """Receive chunks for up to ``timeout`` seconds (returns after the first batch)."""
        if self.router.poll(int(timeout * 1000)):
            while self.router.poll(0):
                frames = self.router.recv_multipart()
                chunks = wire.chunks_in(wire.decode_output(frames[1], wire.MAX_DATA_FRAME))
                assert chunks is not None
                self.received += 1
                for c in chunks:
                    self.chunks.setdefault(c.req, []).append(c)
                    self.arrived.append(c)

    def wait(self, req: str, match: Callable[[wire.DataChunk], bool], timeout: float) -> None:
        """Receive until a chunk of ``req`` satisfies ``match``."""
        deadline = time.monotonic() + timeout
        while not any(match(c) for c in self.chunks.get(req, [])):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{req}: no matching chunk in {timeout} s: {self.chunks}")
            self.pump(left)

    def result(self, req: str, timeout: float = 120.0) -> list[wire.DataChunk]:
        """Every chunk of ``req`` up to its last (a finish reason or an error)."""
        self.wait(req, lambda c: c.finish_reason is not None or c.error is not None, timeout)
        return self.chunks[req]

    def answer(self, route: list[RunnerProcess], req: str, **kw: object) -> list[wire.DataChunk]:
        """Run ``req`` on ``route`` to its end; its chunks, none an error. Returns
        once stage 0 freed it (its release walked the chain)."""
        self.generate(route, req, **kw)
        chunks = self.result(req)
        assert not any(c.error for c in chunks), chunks
        route[0].wait_active(0, 10)
        return chunks

    def close(self) -> None:
        """Close every socket."""
        for d in self._dealers.values():
            d.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def text_of(chunks: list[wire.DataChunk]) -> str:
    """The text of a request's chunks."""
    return "".join(c.text for c in chunks)


def tokens_of(chunks: list[wire.DataChunk]) -> list[int]:
    """The tokens of a request's chunks."""
    return [t for c in chunks for t in c.tokens]

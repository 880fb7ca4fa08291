"""A runner subprocess as its node tracks it (:class:`RunnerProc`), and the questions
the supervisor asks of them: the failure a heartbeat may carry, whether a local file is
the placed one, the machine's decode speed, which draft model each stage 0 asks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

from meshd.crdt.views import RunnerStatus
from meshd.domain.facts import ModelFacts
from meshd.engines.protocol import (
    Beat,
    Failed,
    Listening,
    Load,
    Ready,
    RunnerConfig,
    RunnerEvent,
    SetDraft,
    ThreadsSet,
    encode,
)
from meshd.models.folder import folder_sha256
from meshd.models.hashing import file_sha256
from meshd.transport import wire

from .stage_runners import StageKey

__all__ = ["RunnerProc", "decode_bps", "is_placed_file", "public_reason", "tell_drafts"]


log = logging.getLogger("meshd.supervisor")


@dataclass
class RunnerProc:
    key: StageKey
    config: RunnerConfig
    proc: asyncio.subprocess.Process | None = None
    state: str = "loading"
    reason: str = ""
    port: int = 0
    generation: int = 0
    active: int = 0
    waiting: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    #: Monotonic times of unexpected exits (crash-loop breaker).
    crashes: list[float] = field(default_factory=list)
    #: While fetching its slice: bytes verified, of the total, and the rate.
    fetched: int = 0
    fetch_total: int = 0
    fetch_rate: float = 0.0
    #: Milliseconds per layer of its decode steps, and the mean bytes a decoded token
    #: reads of its layers (a MoE block: its active experts, not all of them): together,
    #: how fast this machine reads weights (``Supervisor.decode_bps``).
    layer_ms: float = 0.0
    layer_bytes: float = 0.0
    #: The draft model its process was told to ask (stage 0): instance and address.
    draft: tuple[str, wire.Addr] | None = None
    #: Tokens it drafted for other models' requests (a draft model's runner).
    proposed: int = 0
    #: Its engine calls that ran prompt steps, those steps, the most in one call.
    prefills: tuple[int, int, int] = (0, 0, 0)
    #: Its last beat (monotonic), what it said, and why it stalled, if it did
    #: (``meshd.node.watchdog``).
    last_beat: float = 0.0
    step_s: float = 0.0
    expect_s: float = 0.0
    stall: str = ""
    #: The CPU threads it said it computes with (0: not said; see ``thread_tuner``).
    threads: int = 0

    def take(self, ev: RunnerEvent | None) -> bool:
        """Note what the runner said on stdout; whether its status changed (a beat
        or a line that is no event changes nothing the heartbeat carries)."""
        if isinstance(ev, Beat):
            self.last_beat, self.step_s, self.expect_s = time.monotonic(), ev.step_s, ev.expect_s
            return False
        k = self.key
        if isinstance(ev, Listening):
            self.port = ev.port
        elif isinstance(ev, Ready):
            self.state, self.layer_ms, self.last_beat = "ready", ev.layer_ms, time.monotonic()
            log.info("runner %s stage %d ready on port %d (%.3f ms a layer)",
                     k.instance, k.stage, self.port, self.layer_ms)  # fmt: skip
        elif isinstance(ev, Load):
            self.active, self.waiting, self.proposed = ev.active, ev.waiting, ev.proposed
            self.layer_ms = ev.layer_ms or self.layer_ms
            self.prefills = (ev.prefill_calls, ev.prefill_steps, ev.widest_prefill)
        elif isinstance(ev, ThreadsSet):
            self.threads = ev.n
            return False  # not in the heartbeat
        elif isinstance(ev, Failed):
            self.state, self.reason = "failed", public_reason(ev.reason)
            log.warning("runner %s stage %d failed: %s", k.instance, k.stage, self.reason)
        return ev is not None

    def signal(self, *, kill: bool) -> None:
        """SIGTERM the process (SIGKILL with ``kill``), if it still runs."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill() if kill else self.proc.terminate()

    def status(self) -> RunnerStatus:
        fetching = self.state == "fetching"
        return RunnerStatus(
            instance=self.key.instance,
            generation=self.generation,
            stage=self.key.stage,
            state=self.state,  # type: ignore[arg-type]  # one of RunnerStatus's literals
            reason=self.reason,
            port=self.port,
            active=self.active,
            waiting=self.waiting,
            fetched=self.fetched if fetching else 0,
            fetch_total=self.fetch_total if fetching else 0,
            fetch_rate=round(self.fetch_rate, 1) if fetching else 0.0,
        )


_PATH = re.compile(r"(?<![\w.])(?:~|/)[^\s'\"():,]*")


def public_reason(reason: str) -> str:
    """A runner's failure as it may travel in the heartbeat: paths replaced, so that no
    peer learns what is on this node's disk (the node's own log keeps the whole text)."""
    return _PATH.sub("<path>", reason)[:300]


async def is_placed_file(
    path: str, facts: ModelFacts | None, cache_dir: Path, running: RunnerProc | None = None
) -> bool:
    """Whether the local file is the placed one (by sha256, cached by path, size and
    mtime); True when that cannot be told here (the runner checks again), or when a
    runner already runs on it (checked before it started, not at every reconcile)."""
    if facts is None or not facts.sha256:
        return True
    if running is not None and running.key.model_path == path:
        return True
    p = Path(path)
    digest = folder_sha256 if p.is_dir() else file_sha256
    try:
        local = await asyncio.to_thread(digest, p, cache_dir)
    except OSError:
        return True  # the runner says what is wrong with it
    return local == facts.sha256


def decode_bps(runners: Iterable[RunnerProc]) -> float:
    """Bytes of weights a decode step reads per second here, as this node's ready
    runners measured it (their mean, by layer bytes); 0.0 before any measured.

    Decode reads every weight once a step, so the rate is the machine's, not the
    model's: placement predicts any model's ms per layer from it."""
    timed = [r for r in runners if r.state == "ready" and r.layer_ms > 0 and r.layer_bytes > 0]
    if not timed:
        return 0.0
    rate = fmean(r.layer_bytes / (r.layer_ms / 1000) for r in timed)
    return float(f"{rate:.3g}")


def tell_drafts(
    runners: Iterable[RunnerProc], pick: Callable[[str], tuple[str, wire.Addr] | None]
) -> None:
    """Tell each stage 0 among ``runners`` the draft model ``pick(instance)`` names
    for its instance, where that changed (see ``meshd.placement.drafts``)."""
    for r in runners:
        p = r.proc
        if r.key.stage != 0 or p is None or p.stdin is None or p.returncode is not None:
            continue
        choice = pick(r.key.instance)
        if choice != r.draft:
            r.draft = choice
            iid, addr = choice if choice else (None, None)
            p.stdin.write(encode(SetDraft(instance=iid, addr=addr)) + b"\n")

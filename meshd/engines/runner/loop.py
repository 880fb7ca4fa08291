"""The runner's message loop: the ROUTER's frames, the node's commands on stdin and
the clock, turned into calls on the stage's :class:`~.core.RunnerCore`; output flushed
after each turn. The loop is plain synchronous Python: compute blocks, and nothing else
shares this process."""

from __future__ import annotations

import logging
import time
from typing import cast

import zmq

from meshd.engines.calibrate import calibrate
from meshd.engines.protocol import (
    Expired,
    RunnerConfig,
    SetDraft,
    SetGeneration,
    SetMembers,
    SetThreads,
    Stop,
    ThreadsSet,
    decode_command,
)
from meshd.engines.stage import Stage, set_threads
from meshd.transport import wire
from meshd.transport.members import Members
from meshd.transport.security import HANDSHAKE_EVENTS, CurveKeys, HandshakeReporter, sender_key
from meshd.transport.sockets import decode_frame

from .core import RunnerCore
from .heart import Heart
from .links import Links, emit
from .state import Counters
from .stdin import StdinLines
from .waiting import NOTICE_MIN_S

log = logging.getLogger("meshd.runner")

#: Seconds after loading at which an idle stage times a decode step again.
RETIME_AFTER_S = (5.0, 30.0)


class Runner:
    """The message loop around one engine stage."""

    def __init__(
        self,
        cfg: RunnerConfig,
        stage: Stage,
        ctx: zmq.Context,
        router: zmq.Socket,
        template: str | None = None,
        keys: CurveKeys | None = None,
        members: Members | None = None,
    ) -> None:
        self.keys = keys
        self.router = router
        #: The cluster's members (None: an open cluster): whom ZAP and :meth:`read_frames`
        #: admit, and the keys of the nodes this stage dials.
        self.members = members
        self.links = Links(ctx, keys, cfg, Counters(), members)
        self.core = RunnerCore(cfg, stage, self.links, template)
        self.expiry = cfg.request_expiry_s
        # Checked a few times per expiry, at most once a second: a scan is O(requests).
        self._expiry_every = min(1.0, max(0.01, self.expiry / 4))
        self._next_expiry_check = (
            time.monotonic() + self._expiry_every if self.expiry > 0 else float("inf")
        )
        #: When to time a decode step again while idle: the timing at load ran beside
        #: other stages loading on the same cores (see :meth:`retime`).
        self._retime_at = [time.monotonic() + t for t in RETIME_AFTER_S]
        self._next_notice = 0.0
        self.heart = Heart()

    def serve(self, stdin: StdinLines) -> None:
        """Serve until the node closes stdin or says ``stop``, beating all along."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(stdin.fd, zmq.POLLIN)
        mon, reporter = None, None
        if self.keys is not None:
            mon = self.router.get_monitor_socket(HANDSHAKE_EVENTS)
            poller.register(mon, zmq.POLLIN)
            reporter = HandshakeReporter(lambda _s, reason: self.links.counters.drop(reason))
        if not self.control(stdin.buffered()):
            self.links.flush()
            return
        self.heart.start()
        try:
            self._serve(poller, stdin, mon, reporter)
        finally:
            self.heart.stop()

    def _serve(
        self,
        poller: zmq.Poller,
        stdin: StdinLines,
        mon: zmq.Socket[bytes] | None,
        reporter: HandshakeReporter | None,
    ) -> None:
        core = self.core
        while True:
            events = dict(poller.poll(self._poll_ms()))
            if self.router in events:
                self.read_frames()
                self.links.flush()  # acknowledgements and errors: not after a step
            ds = core.draft_server
            if ds is not None:
                if ds.asks:
                    ds.run()  # before this stage's own step: a pipeline waits
                ds.report(core.report_load)
            if core.drafts.pending:
                core.spec.run_undrafted(core.reqs, time.monotonic())
            if mon is not None and reporter is not None and mon in events:
                reporter.event("stage", mon.recv_multipart())
            if stdin.fd in events and not self.control(stdin.read()):
                self.links.flush()
                return
            if core.work:
                self.heart.stepping(self.expected_s())
                core.step()
                self.heart.idle()
            self.links.flush()
            self.tick(time.monotonic())

    def expected_s(self) -> float:
        """What the next step should take at most, from the measured decode speed:
        every queued row as a decode step of its own (a prefill's rows cost less
        each), so it errs long (0: not measured yet)."""
        clock = self.core.clock
        rows = sum(w.rows for w in self.core.work)
        return clock.ms * clock.n_layers * max(1, rows) / 1000

    def _poll_ms(self) -> int:
        """How long the loop may sleep: not at all with work queued, else until the
        first step waiting for a draft gives up on it or held output is due (or 200 ms)."""
        if self.core.work:
            return 0
        due = (self.core.drafts.next_deadline(), self.links.outbox.next_due())
        dues = [d for d in due if d is not None]
        if not dues:
            return 200
        return max(0, min(200, int((min(dues) - time.monotonic()) * 1000) + 1))

    def read_frames(self) -> None:
        """Handle every frame waiting on the ROUTER; a bad one is dropped and counted."""
        # Ask the socket whether input waits rather than catch zmq.Again: the exception
        # cost showed on every hop's profile.
        router = self.router
        counters = self.links.counters
        members = self.members
        while cast(int, router.get(zmq.EVENTS)) & zmq.POLLIN:
            frames = router.recv_multipart(copy=False)
            if len(frames) < 2:
                counters.drop("shape")
                continue
            if members is not None and not members.admits(sender_key(frames[1])):
                # Connected before its removal (ZAP ran then): no longer heard.
                counters.drop("not_member")
                continue
            msg = decode_frame(frames[1].buffer, counters.drop, wire.decode_stage)
            if msg is None:
                continue
            try:
                self.core.handle(msg, frames[2:])
            except Exception:
                log.exception("error handling %s", type(msg).__name__)
                counters.drop("error")

    def control(self, lines: list[bytes] | None) -> bool:
        """Handle the node's commands in ``lines``; False when the node closed stdin
        (``lines`` is None: it is gone) or said ``stop``."""
        if lines is None:
            return False
        for line in lines:
            cmd = decode_command(line)
            if isinstance(cmd, SetGeneration):
                self.core.set_generation(cmd.value)
            elif isinstance(cmd, SetMembers) and self.members is not None:
                # Changed in place: the ZAP thread reads it (see Members.replace).
                gone = self.members.replace({n: k.encode() for n, k in cmd.members.items()})
                for nid in gone:
                    self.links.dealers.drop_node(nid)
            elif isinstance(cmd, SetDraft):
                self.core.drafts.set(cmd.instance, cmd.addr)
            elif isinstance(cmd, SetThreads):
                # Commands run between steps only: a step never changes threads midway.
                emit(ThreadsSet(n=set_threads(self.core.stage, cmd.n)))
            elif isinstance(cmd, Stop):
                return False
        return True

    def tick(self, now: float) -> None:
        """What is due by the clock: the waiting requests' places, expiring idle
        requests, timing a step again."""
        if now >= self._next_notice:
            self._next_notice = now + NOTICE_MIN_S / 2
            self.core.requests.tell_places()
        if now >= self._next_expiry_check:
            self._next_expiry_check = now + self._expiry_every
            self.expire(now)
        if self._retime_at and now >= self._retime_at[0]:
            self.retime()

    def expire(self, now: float) -> None:
        """Free requests idle for longer than ``request_expiry_s``.

        A request is idle when no message for it arrived and none of its work ran: the
        stages before it are gone (a dead stage 0 cannot send the cancel that would
        free this one) or the API node left without a cancel reaching here. A request
        with work still queued is busy, not idle.
        """
        core = self.core
        busy = {w.req for w in core.work}
        idle = [
            r for r in core.reqs.values()
            if now - r.last_active > self.expiry and r.req not in busy
        ]  # fmt: skip
        for r in idle:
            core.counters.expired += 1
            log.warning(
                "request %s idle for %.0f s on stage %d: freed (%d expired so far)",
                r.req, now - r.last_active, core.cfg.stage, core.counters.expired,
            )  # fmt: skip
            emit(Expired(req=r.req, total=core.counters.expired))
            self.links.fail(
                r.reply_to, r.req, "timeout",
                f"request idle for {self.expiry:g} s on stage {core.cfg.stage}; freed",
            )  # fmt: skip
            # "cancel" walks on: the stages after this one hold the same dead request.
            core.release(r.req, "cancel")
        if core.draft_server is not None:
            core.draft_server.expire(now, self.expiry)

    def retime(self) -> None:
        """Time a decode step again if the stage is idle and nothing it ran has been
        timed yet; the least of the figures is kept (a machine's speed, not the
        moment's)."""
        self._retime_at.pop(0)
        core = self.core
        free = core.seats.free
        if core.reqs or core.work or not free or core.clock.steps:
            return
        try:
            ms = calibrate(core.stage, core.cfg.end - core.cfg.start, free[-1])
        except Exception:
            log.debug("could not time a decode step", exc_info=True)
            return
        if ms > 0 and (core.clock.ms <= 0 or ms < core.clock.ms):
            core.clock.ms = core.clock.reported = ms
            core.report_load()

    def close(self) -> None:
        """Close the sockets this runner opened (the ROUTER is its caller's)."""
        self.links.close()

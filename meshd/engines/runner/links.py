"""Everything a runner sends: data-plane messages to other runners and to API nodes
(output coalesced by the :class:`~meshd.engines.outbox.Outbox`), and the status lines
its supervisor reads on stdout."""

from __future__ import annotations

import logging
import sys
import threading

import zmq

from meshd.engines.outbox import Outbox
from meshd.engines.protocol import RunnerConfig, RunnerEvent, encode
from meshd.transport import wire
from meshd.transport.addresses import local_addresses
from meshd.transport.members import Members
from meshd.transport.security import CurveKeys, NoServerKey
from meshd.transport.sockets import DealerCache

from .state import Counters

log = logging.getLogger("meshd.runner")


_EMITTING = threading.Lock()


def emit(event: RunnerEvent) -> None:
    """One status line for the supervisor (whole, whichever thread sends it)."""
    line = encode(event).decode() + "\n"
    with _EMITTING:
        sys.stdout.write(line)
        sys.stdout.flush()


class Links:
    """A runner's outgoing side: one DEALER per peer address, and the outbox its
    DataChunks wait in until the loop flushes."""

    def __init__(
        self,
        ctx: zmq.Context,
        keys: CurveKeys | None,
        cfg: RunnerConfig,
        counters: Counters,
        members: Members | None = None,
    ) -> None:
        self.instance = cfg.instance
        self.stage = cfg.stage
        self.n_stages = cfg.n_stages
        self.counters = counters
        self.dealers = DealerCache(
            ctx, keys=keys, own_addresses=local_addresses(),
            server_key=members.key_of if members is not None else lambda node: None,
        )  # fmt: skip
        #: Where DataChunks go: a request's tokens coalesce while they come fast.
        self.outbox = Outbox(self.send, cfg.stream_interval_s)

    def send(self, addr: wire.Addr, msg: wire.Message, *frames: object) -> None:
        """Send ``msg`` (and raw ``frames``) to ``addr`` now; a full queue drops it
        (counted): a peer that does not read must not block this stage."""
        try:
            d = self.dealers.to(addr)
        except NoServerKey:
            self.counters.drop("not_member")  # a plan names a node that is no member
            return
        try:
            d.send_multipart([wire.encode(msg), *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.counters.drop("send_queue_full")

    def chunk(self, reply_to: wire.Addr, c: wire.DataChunk) -> None:
        """Queue ``c`` for its API node (see :class:`Outbox`)."""
        self.outbox.put(reply_to, c)

    def fail(
        self,
        reply_to: wire.Addr,
        req: str,
        code: str,
        message: str,
        *,
        blame: bool = False,
        n_prompt: int = 0,
    ) -> None:
        """End ``req`` at its API node with a typed error (``blame``: this stage is at
        fault, and the error says which stage it is; ``n_prompt``: the tokens of a
        prompt over the context)."""
        log.info("request %s ends at stage %d: %s: %s", req, self.stage, code, message,
                 extra={"req": req})  # fmt: skip
        stage = self.stage if blame else -1
        self.outbox.put(reply_to, error_chunk(req, code, message, stage, n_prompt))

    def token(
        self, to: wire.Addr, req: str, generation: int, tok: int, pos: int, epoch: int
    ) -> None:
        """Tell stage 0 the token to feed at ``pos`` (a restart: ``epoch``)."""
        self.send(to, wire.Token(req=req, instance=self.instance, generation=generation,
                                 token=tok, pos=pos, epoch=epoch))  # fmt: skip

    def release(self, to: wire.Addr, req: str, reason: str, n_kv: int = -1) -> None:
        """Tell the runner at ``to`` that ``req`` is over (``reason``)."""
        self.send(to, wire.Release(req=req, instance=self.instance, reason=reason, n_kv=n_kv))

    def pass_release(self, route: list[wire.Addr], req: str, reason: str, n_kv: int) -> None:
        """Walk a release on from this stage: a finished answer's from the last stage
        to stage 0, then down the chain to the stage before the last; a cancel down
        the whole chain."""
        nxt = self.stage + 1
        last = self.stage == self.n_stages - 1
        if last and self.stage != 0 and reason == "done":
            self.release(route[0], req, reason, n_kv)
        elif nxt < self.n_stages and (reason == "cancel" or nxt < self.n_stages - 1):
            self.release(route[nxt], req, reason, n_kv)

    def flush(self) -> None:
        """Send the output that is due."""
        self.outbox.flush()

    def close(self) -> None:
        """Close every DEALER."""
        self.dealers.close()


def error_chunk(
    req: str, code: str, message: str, stage: int = -1, n_prompt: int = 0
) -> wire.DataChunk:
    """The chunk that ends ``req`` with a typed error (``stage``: the one at fault;
    ``n_prompt``: a prompt's tokens, when it is over the context)."""
    error = wire.ChunkError(code=code, message=message, stage=stage)
    return wire.DataChunk(req=req, error=error, n_prompt=n_prompt or None)

"""This node's part in weights over the mesh: it serves the slices of the models it
holds, and fetches the slice of a stage it was placed without the model's file.

The transfer itself (chunks, flow control, verification, resume, several holders) is
``meshd.transport.transfer``; this module answers its two questions for this node:
which file and slice a peer's :class:`~meshd.transport.wire.SliceAsk` means (only a
model under this node's roots, only the very file with the asked sha256), and which
peers hold the model a stage here lacks (the cluster's cards).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import zmq.asyncio

from meshd.crdt.views import Instance
from meshd.models import ModelNotFoundError, canonical_name
from meshd.models.errors import ModelFormatError
from meshd.models.folder import folder_sha256
from meshd.models.folder_slicing import folder_slice_path, slice_folder, unpack_folder_slice
from meshd.models.hashing import file_sha256
from meshd.models.manifest import SLICE_FORMAT_VERSION, Manifest, manifest_for, slice_id
from meshd.models.slice_check import SliceMismatch, check_slice
from meshd.models.slicing import slice_gguf, slice_path
from meshd.transport import wire
from meshd.transport.security import CurveKeys
from meshd.transport.stats import DropCounters
from meshd.transport.transfer import (
    FetchProgress,
    SliceRejected,
    SliceUnavailable,
    WeightServer,
    fetch_slice,
)

from .roots import ModelRoots
from .state import ClusterState

__all__ = ["Weights"]

log = logging.getLogger("meshd.weights")


class Weights:
    """Serves this node's slices; fetches the slices its stages lack."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        state: ClusterState,
        roots: ModelRoots,
        *,
        cache_dir: Path,
        own_addresses: list[str],
        bind_host: str = "0.0.0.0",
        keys: CurveKeys | None = None,
        server_key: Callable[[str], bytes | None] = lambda node: None,
        admits: Callable[[bytes], bool] | None = None,
        counters: DropCounters | None = None,
    ) -> None:
        self.ctx = ctx
        self.state = state
        self.roots = roots
        self.cache_dir = Path(cache_dir)
        self.own_addresses = own_addresses
        self.keys = keys
        self.server_key = server_key
        self.counters = counters or DropCounters()
        self.server = WeightServer(
            ctx, prepare=self.prepare, bind_host=bind_host, keys=keys, counters=self.counters,
            admits=admits,
        )  # fmt: skip

    @property
    def port(self) -> int:
        """The weights ROUTER's port (``weights_port`` in the card)."""
        return self.server.port

    def start(self) -> None:
        """Serve slices."""
        self.server.start()

    async def stop(self) -> None:
        """Stop serving (fetches in progress are the supervisor's: it cancels them)."""
        await self.server.stop()

    # -- holder ------------------------------------------------------------------------
    def prepare(self, ask: wire.SliceAsk) -> tuple[Path, Manifest]:
        """The file and manifest of the slice ``ask`` names (blocking: cuts and hashes
        it the first time). Raises SliceUnavailable when this node cannot offer it."""
        try:
            resolved = self.roots.resolve(ask.model)
        except ModelNotFoundError:
            raise SliceUnavailable("not_held", f"{ask.model!r} is not held here") from None
        src = Path(resolved.path)
        folder = resolved.format == "mlx"
        if not (src.is_dir() if folder else src.is_file()):
            raise SliceUnavailable("not_held", f"{ask.model!r} here is not a model")
        sha = folder_sha256(src, self.cache_dir) if folder else file_sha256(src, self.cache_dir)
        if sha != ask.sha256:
            raise SliceUnavailable(
                "not_held",
                f"{ask.model!r} here is another file (sha256 {sha[:12]}, asked {ask.sha256[:12]})",
            )
        cut = slice_folder if folder else slice_gguf
        try:
            path = cut(src, ask.start, ask.end, self.cache_dir, sha)
        except (ValueError, ModelFormatError) as e:
            raise SliceUnavailable("bad_range", str(e)) from None
        sid = slice_id(sha, ask.start, ask.end)
        where = folder_slice_path if folder else slice_path
        store = where(self.cache_dir, sha, ask.start, ask.end)
        m = manifest_for(path, sid, store.with_name(store.name + ".manifest"))
        log.info(
            "weights: offering %s [%d, %d) (%d bytes, root %s)",
            ask.model, ask.start, ask.end, m.size, m.root[:12],
        )  # fmt: skip
        return path, m

    # -- fetcher -----------------------------------------------------------------------
    def can_fetch(self, inst: Instance) -> bool:
        """Whether a live node serves the slices of ``inst``'s model (the placed file):
        else a stage here that lacks the model has nothing to fetch it from."""
        facts = inst.facts
        if facts is None or not facts.sha256:
            return False
        return bool(self.state.view().weight_holders(inst.spec.model, facts.sha256))

    async def fetch(
        self,
        inst: Instance,
        i: int,
        dest: Path,
        on_progress: Callable[[int, int, float], None],
    ) -> Manifest:
        """Fetch stage ``i`` of ``inst``'s slice into ``dest`` from the live nodes that
        advertise the model with the placed sha256: the bytes most of them offer, checked
        against the model's facts before anything may load them."""
        facts = inst.facts
        if facts is None:
            raise ValueError(f"instance {inst.id} has no model facts")
        st = inst.stages[i]
        model = canonical_name(inst.spec.model)
        ask = wire.SliceAsk(
            model=model, sha256=facts.sha256, start=st.start, end=st.end,
            version=SLICE_FORMAT_VERSION,
        )  # fmt: skip

        def holders() -> list[wire.Addr]:
            return self.state.view().weight_holders(model, facts.sha256)

        def progress(p: FetchProgress) -> None:
            on_progress(p.done, p.total, p.rate)

        # A folder slice travels as one archive, unpacked once every byte is verified.
        archive = (
            folder_slice_path(self.cache_dir, facts.sha256, st.start, st.end)
            if facts.format == "mlx"
            else dest
        )

        def verify(path: Path, _m: Manifest) -> None:
            try:
                check_slice(path, facts, st.start, st.end)
            except SliceMismatch as e:
                raise SliceRejected(str(e)) from None

        m = await fetch_slice(
            self.ctx, holders=holders, ask=ask, dest=archive,
            own_addresses=self.own_addresses, keys=self.keys, server_key=self.server_key,
            on_progress=progress, verify=verify, counters=self.counters,
        )  # fmt: skip
        if archive != dest:
            await asyncio.to_thread(unpack_folder_slice, archive, dest)
            for f in (archive, archive.with_name(archive.name + ".manifest")):
                f.unlink(missing_ok=True)
        log.info("weights: slice %s of %s verified (root %s)", m.slice[:12], model, m.root[:12])
        return m

"""A runner process: one pipeline stage of one model instance.

The node's supervisor starts ``python -m meshd.engines.runner INSTANCE STAGE`` with
the config on stdin (:mod:`meshd.engines.protocol`: events out, commands in; EOF on
stdin means the node is gone: exit). The runner binds a ROUTER on an OS-chosen port,
loads its stage, times a decode step and serves (:class:`~.loop.Runner`). SIGINT is
ignored (a Ctrl-C in the node's terminal is the node's to handle: it drains first);
the supervisor stops a runner with SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import msgspec
import zmq

from meshd.domain.builds import MLX_KV_REFUSAL
from meshd.engines.calibrate import calibrate
from meshd.engines.protocol import Failed, Listening, Ready, RunnerConfig, decode_config
from meshd.engines.stage import Stage
from meshd.engines.threads import configure_threads
from meshd.logs import configure as configure_logs
from meshd.models.chat import chat_template_at
from meshd.models.folder import folder_sha256
from meshd.models.hashing import file_sha256
from meshd.models.slicing import slice_gguf
from meshd.transport.members import Members
from meshd.transport.security import start_zap
from meshd.transport.sockets import DATA, bind, open_socket

from .links import emit
from .loop import Runner
from .stdin import StdinLines

log = logging.getLogger("meshd.runner")


def main(argv: list[str] | None = None) -> int:
    """Entry point of a runner process (``python -m meshd.engines.runner INSTANCE STAGE``,
    the config on stdin)."""
    # A Ctrl-C in the node's terminal reaches its whole process group; the node drains
    # (its stages move, its streams finish) and then stops its runners itself. A runner
    # that died on the same SIGINT would cut every stream mid-drain and count as a
    # crash. SIGTERM stays fatal: it is how the supervisor stops a runner.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Text at info until the config (the first line) says how its node logs.
    name = f"runner {os.getpid()}"
    configure_logs("info", "text", name=name)
    stdin = StdinLines()
    try:
        cfg = decode_config(stdin.first())
    except (EOFError, msgspec.DecodeError, msgspec.ValidationError) as e:
        emit(Failed(reason=f"bad runner config: {e}"))
        return 1
    configure_logs(cfg.log_level, cfg.log_format, name=name)
    ctx = zmq.Context()
    keys = cfg.keys.curve() if cfg.keys is not None else None
    members: Members | None = None
    if cfg.keys is not None:
        members = Members({n: k.encode() for n, k in cfg.keys.members.items()})
        start_zap(ctx, members.admits, lambda: log.warning("refused a non-member peer"))
    router = open_socket(ctx, zmq.ROUTER, DATA, keys, server=True)
    port = bind(router, cfg.bind_host)
    emit(Listening(port=port))
    try:
        stage = load_stage(cfg)
        template = None
        if cfg.stage == 0:
            template = chat_template_at(cfg.model_path)
    except Exception as e:
        log.exception("could not load the stage")
        emit(Failed(reason=f"{type(e).__name__}: {e}"))
        return 1
    try:
        layer_ms = calibrate(stage, cfg.end - cfg.start)
    except Exception:
        # A figure for placement, not a condition of serving.
        log.warning("could not time a decode step", exc_info=True)
        layer_ms = 0.0
    emit(Ready(layer_ms=round(layer_ms, 4)))
    runner = Runner(cfg, stage, ctx, router, template, keys, members)
    runner.core.clock.ms = runner.core.clock.reported = layer_ms
    try:
        runner.serve(stdin)
    finally:
        runner.close()
        router.close(linger=0)
    return 0


def check_model(cfg: RunnerConfig) -> None:
    """Refuse to run weights other than the ones placed.

    The plan names a model by path or repo id, and this node resolved it to a local
    file; another machine's file at the same path can be another model (or another
    quantization). Stages of different weights would run together and produce garbage
    without any error, and slices are cached by the placed sha256. The local hash is
    cached by (path, size, mtime), so a model is hashed once per change.
    """
    if not cfg.sha256 or cfg.sliced:
        return
    path = Path(cfg.model_path)
    if path.is_dir():
        local = folder_sha256(path, Path(cfg.cache_dir))
    else:
        local = file_sha256(path, Path(cfg.cache_dir))
    if local != cfg.sha256:
        raise ValueError(
            f"{path} on this node is not the model that was placed "
            f"(sha256 {local[:12]} here, {cfg.sha256[:12]} in the plan)"
        )


def load_stage(cfg: RunnerConfig) -> Stage:
    """Load this stage's layers in its engine (a llama.cpp slice, or MLX on the GGUF)."""
    check_model(cfg)
    first, last = cfg.stage == 0, cfg.stage == cfg.n_stages - 1
    # A fetched slice holds the stage's blocks only, numbered from 0.
    start, end = (0, cfg.end - cfg.start) if cfg.sliced else (cfg.start, cfg.end)
    if cfg.engine == "mlx":
        from meshd.engines.mlx_stage import MlxStage

        if cfg.kv_cache != "f16":  # placement never plans it (a plan of an older one)
            raise ValueError(MLX_KV_REFUSAL.format(kv_cache=cfg.kv_cache))
        return MlxStage(
            Path(cfg.model_path), start=start, end=end, first=first, last=last,
            n_ctx=cfg.n_ctx, n_seq_max=cfg.n_seq_max, exact=cfg.exact,
        )  # fmt: skip
    if cfg.engine != "llama_cpp":
        raise ValueError(f"engine {cfg.engine!r} is not available in this runner")
    from meshd.engines.llama_stage import LlamaStage

    configure_threads()
    path = Path(cfg.model_path)
    if not cfg.sliced:
        # A plan without the model's sha256 (an old one) names slices by the local hash.
        sha = cfg.sha256 or file_sha256(path, Path(cfg.cache_dir))
        path = slice_gguf(path, cfg.start, cfg.end, Path(cfg.cache_dir), sha)
    return LlamaStage(
        path, first=first, last=last, n_ctx=cfg.n_ctx, n_seq_max=cfg.n_seq_max,
        exact=cfg.exact, n_threads=cfg.n_threads, kv_cache=cfg.kv_cache,
        n_gpu_layers=cfg.n_gpu_layers,
    )  # fmt: skip

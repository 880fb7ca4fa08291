"""CPU threads of the runners on one machine, decided in one place.

``$MESHD_THREADS`` (read here only) fixes the threads of every stage; otherwise a node's
runners split the cores between them, so co-located stages do not fight over them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

__all__ = [
    "GOMP_DEFAULT_SPINCOUNT",
    "GOMP_SPINCOUNT",
    "RUNNER_ENV_KEEP",
    "THREADS_ENV",
    "configure_threads",
    "default_threads",
    "runner_env",
    "runner_spincount",
    "threads_from_env",
    "threads_per_runner",
]

log = logging.getLogger("meshd.engines.threads")

#: Environment variable that fixes every stage's thread count.
THREADS_ENV = "MESHD_THREADS"

#: OpenMP spin count for runner processes. llama.cpp's CPU backend uses OpenMP, whose
#: workers spin-wait after each op by default; two runners on the same cores then
#: burn each other's time (measured 8.0 vs 4.8 ms/token on 2 cores). ~1e4 keeps the
#: wake-up fast inside one decode and yields soon after it.
GOMP_SPINCOUNT = 10_000

#: libgomp's own spin count where its threads do not outnumber the cores (what a
#: llama.cpp program gets unless told otherwise): 4-7 ms of spinning after a step on a
#: 2-core VM (the process's CPU time in the second after one decode).
GOMP_DEFAULT_SPINCOUNT = 300_000


def runner_spincount(n_stages: int, n_runners: int) -> int:
    """``GOMP_SPINCOUNT`` for a runner of an instance of ``n_stages`` stages on a node
    that runs ``n_runners`` runners.

    A whole model alone on its node goes from one step straight to the next, with only
    its own Python between them: libgomp's default keeps the workers spinning through
    that gap instead of asleep, and waking them costs the next step more than the gap
    (bench/compare.py, 1 stage on 2 cores: 11.3 against 12.4-12.5 ms a token). A
    pipeline stage waits for the ring between its steps, and runners that share a
    node's cores would spin in each other's time (8.0 against 4.8 ms a token): those
    yield soon (:data:`GOMP_SPINCOUNT`)."""
    return GOMP_DEFAULT_SPINCOUNT if n_stages == 1 and n_runners == 1 else GOMP_SPINCOUNT


def threads_from_env() -> int | None:
    """``$MESHD_THREADS`` when it is a positive number, else None."""
    env = os.environ.get(THREADS_ENV, "")
    return int(env) if env.isdigit() and int(env) > 0 else None


def threads_per_runner(n_runners: int) -> int | None:
    """CPU threads each of this node's ``n_runners`` runners gets: the cores split
    evenly, so co-located stages do not fight over them (bench/compare.py: stages of 2
    threads each sharing 2 cores served 8 streams at a fifth of one stage's rate).
    ``None`` lets ``$MESHD_THREADS`` decide."""
    if threads_from_env() is not None:
        return None
    return max(1, default_threads() // max(1, n_runners))


def default_threads() -> int:
    """Threads a stage uses when not told: ``$MESHD_THREADS``, else the cores this
    process may run on."""
    fixed = threads_from_env()
    if fixed is not None:
        return fixed
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        return max(1, os.cpu_count() or 1)


#: What a runner keeps of its node's environment (a name, or a prefix ending in ``_``):
#: what Python, the engines, their thread pools, the GPU runtimes and the HF cache read.
#: Nothing else reaches a runner: not the API key, not the cluster secret, nor whatever
#: the node's own environment happens to hold.
RUNNER_ENV_KEEP = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_", "TZ", "TMPDIR", "TEMP",
    "TMP", "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
    "VIRTUAL_ENV", "LD_LIBRARY_PATH", "DYLD_", "OMP_", "GOMP_", "KMP_", "MKL_",
    "OPENBLAS_", THREADS_ENV, "HF_", "HUGGINGFACE_", "XDG_CACHE_HOME", "CUDA_", "NVIDIA_",
    "HIP_", "ROCM_", "MLX_", "METAL_", "GGML_", "LLAMA_", "SYSTEMROOT", "WINDIR",
    "MESHD_FAULT_INJECT",  # a fault drill (meshd.engines.guard)
    "MESHD_TEST_SCRIPT",  # a test drill (meshd.engines.runner.thinking)
    "MESHD_PREFILL_CHUNK",  # a benchmark's prompt chunks (meshd.engines.runner.chunks)
)  # fmt: skip


def runner_env(
    base: Mapping[str, str] | None = None,
    *,
    spincount: int = GOMP_SPINCOUNT,
    minimal: bool = False,
) -> dict[str, str]:
    """Environment for a runner subprocess that will run llama.cpp stages.

    Returns a copy of ``base`` (``os.environ`` when None) with ``GOMP_SPINCOUNT`` set,
    unless the user set it already. Use it to spawn a runner: libgomp reads the
    variable once, when it is loaded, so the runner must start with it. ``minimal``
    keeps only :data:`RUNNER_ENV_KEEP` (what a node's runners get).
    """
    env = dict(os.environ if base is None else base)
    if minimal:
        env = {k: v for k, v in env.items() if _kept(k)}
        env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("GOMP_SPINCOUNT", str(int(spincount)))
    return env


def _kept(name: str) -> bool:
    return any(name == k or (k.endswith("_") and name.startswith(k)) for k in RUNNER_ENV_KEEP)


def configure_threads(spincount: int = GOMP_SPINCOUNT) -> bool:
    """Set sane OpenMP settings in this (runner) process; call before the first stage.

    Sets ``GOMP_SPINCOUNT`` in ``os.environ`` unless the user set it. libgomp reads it
    when it is loaded, which happens when llama_cpp is first imported: this module
    imports llama_cpp only when the first stage is built, so calling this before that
    works. Returns False (and logs) when llama_cpp is already loaded, so the setting
    cannot take effect any more; spawn with :func:`runner_env` instead.
    """
    if "GOMP_SPINCOUNT" in os.environ:
        return True
    if "llama_cpp" in sys.modules:
        log.warning("llama_cpp is already loaded: GOMP_SPINCOUNT would have no effect")
        return False
    os.environ["GOMP_SPINCOUNT"] = str(int(spincount))
    return True

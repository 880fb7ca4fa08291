"""Detect the engine backends this machine can really run, and their GPUs.

Run as a subprocess (``python -m meshd.engines.probe``) so that importing a native
engine that crashes or hangs cannot take the node down; it prints one JSON object.
A backend is listed only if its engine imports and reports the device; never claimed.
A GPU is listed with the memory its engine reports: llama.cpp's device API
(``ggml_backend_dev_memory``) on a CUDA/Vulkan/Metal build, MLX's ``device_info``.

A machine without a GPU gets the same answer until its engines change, so that answer
is kept in the node's cache (:func:`probe` with ``cache_dir``), keyed by the interpreter
and the engines' installed files: a start skips the subprocess (~0.35 s of CPU and its
wall time before the node is up). An answer with a GPU is never kept: its free memory
is the moment's.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import logging
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import msgspec

from meshd.domain.nodes import Device

log = logging.getLogger("meshd.engines")

PROBE_TIMEOUT = 30.0

#: The kept answer of a machine without a GPU (in the node's cache directory).
PROBE_CACHE = "backends.json"

#: The engines whose installed files the answer depends on: (distribution, package).
_ENGINES = (("llama_cpp_python", "llama_cpp"), ("mlx", "mlx"), ("mlx-metal", "mlx"))


def _llama_cpp() -> list[str]:
    try:
        import llama_cpp
    except Exception:
        return []
    out = ["llama_cpp-cpu"]
    try:
        if llama_cpp.llama_supports_gpu_offload():
            info = llama_cpp.llama_print_system_info().decode(errors="replace").upper()
            for tag, name in (("CUDA", "cuda"), ("METAL", "metal"), ("VULKAN", "vulkan")):
                if tag in info:
                    out.append(f"llama_cpp-{name}")
                    break
            else:
                out.append("llama_cpp-gpu")
    except Exception:
        pass
    return out


def _mlx() -> list[str]:
    try:
        import mlx.core as mx
    except Exception:
        return []
    out = []
    try:
        if mx.metal.is_available():
            out.append("mlx-metal")
    except Exception:
        pass
    try:
        cuda = getattr(mx, "cuda", None)
        if cuda is not None and cuda.is_available():
            out.append("mlx-cuda")
    except Exception:
        pass
    try:
        # Prove the CPU device really computes before claiming it.
        if (mx.array([1, 2]) + 1).sum().item() == 5:
            out.append("mlx-cpu")
    except Exception:
        pass
    return out


#: ggml_backend_dev_type values that are GPUs: dedicated, integrated (host memory).
_GGML_GPU, _GGML_IGPU = 1, 2


def llama_devices(backend: str) -> list[Device]:
    """The GPUs llama.cpp's device registry lists, as ``backend``'s (a GPU build's
    ``llama_cpp-cuda`` and so on), with their free and total memory."""
    import llama_cpp

    from .ggml_lib import load_ggml

    lib = load_ggml(llama_cpp, "libggml.so.0")
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, fn).restype = ctypes.c_char_p
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        kind = int(lib.ggml_backend_dev_type(dev))
        if kind not in (_GGML_GPU, _GGML_IGPU):
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(
            Device(
                backend=backend,
                name=(lib.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                description=(lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                mem_total=int(total.value),
                mem_free=int(free.value),
                # Apple's GPUs and integrated ones share the host's memory.
                unified=kind == _GGML_IGPU or backend == "llama_cpp-metal",
            )
        )
    return out


def mlx_devices(backend: str) -> list[Device]:
    """``backend``'s GPU (``mlx-metal``, ``mlx-cuda``) as MLX's ``device_info`` says:
    on Metal, the recommended working set of the unified memory is what it may use."""
    import mlx.core as mx

    info = mx.device_info()
    total = int(info.get("memory_size") or info.get("total_memory") or 0)
    free = int(info.get("max_recommended_working_set_size") or info.get("free_memory") or total)
    return [
        Device(
            backend=backend,
            name=str(info.get("device_name") or backend),
            mem_total=total,
            mem_free=free,
            unified=backend == "mlx-metal",
        )
    ]


def detect() -> list[str]:
    """Backends available in this interpreter (runs engine imports: use :func:`probe`)."""
    return sorted(set(_llama_cpp() + _mlx()))


def detect_devices(backends: list[str]) -> list[Device]:
    """The GPUs of the GPU ``backends`` (runs engine imports: use :func:`probe`); a
    backend whose engine cannot say is left out, never guessed."""
    out: list[Device] = []
    for b in backends:
        engine, _, kind = b.partition("-")
        if kind == "cpu":
            continue
        try:
            out += llama_devices(b) if engine == "llama_cpp" else mlx_devices(b)
        except Exception:
            log.debug("no device facts for %s", b, exc_info=True)
    return out


class Probed(NamedTuple):
    """What the probe found: engine backends and the GPUs they compute on."""

    backends: list[str]
    devices: list[Device]


def install_key() -> str:
    """What a machine's answer without a GPU depends on: this interpreter and each
    engine's version and native libraries (a GPU build reinstalled over a CPU one at
    the same version changes them). Read without importing the engines."""
    parts = [sys.executable, platform.machine()]
    for dist, package in _ENGINES:
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=-")
            continue
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            libs = Path(root) / "lib"
            for f in sorted(libs.iterdir()) if libs.is_dir() else []:
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def _kept(cache_dir: Path, key: str) -> Probed | None:
    try:
        kept = msgspec.json.decode((cache_dir / PROBE_CACHE).read_bytes(), type=_Kept)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return Probed(kept.backends, []) if kept.key == key else None


def _keep(cache_dir: Path, key: str, found: Probed) -> None:
    if found.devices or any(not b.endswith("-cpu") for b in found.backends):
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".{PROBE_CACHE}.tmp"
        tmp.write_bytes(msgspec.json.encode(_Kept(key=key, backends=found.backends)))
        tmp.replace(cache_dir / PROBE_CACHE)
    except OSError:
        log.debug("could not keep the probe's answer", exc_info=True)


async def probe(timeout: float = PROBE_TIMEOUT, cache_dir: Path | None = None) -> Probed:
    """Detect backends and GPUs in a subprocess, bounded by ``timeout``; none if the
    probe fails. With ``cache_dir``, a kept answer for this install is used, and an
    answer without a GPU is kept."""
    key = install_key() if cache_dir is not None else ""
    if cache_dir is not None and (kept := _kept(cache_dir, key)) is not None:
        return kept
    found = await _probe(timeout)
    if cache_dir is not None and found.backends:
        _keep(cache_dir, key, found)
    return found


async def _probe(timeout: float) -> Probed:
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "meshd.engines.probe",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError:
        log.exception("could not start the backend probe")
        return Probed([], [])
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        log.warning("backend probe timed out after %.0f s; advertising no backends", timeout)
        return Probed([], [])
    try:
        found = msgspec.json.decode(out.decode().strip().splitlines()[-1], type=_Found)
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
        log.warning("backend probe printed nothing usable; advertising no backends")
        return Probed([], [])
    return Probed(found.backends, found.devices)


class _Found(msgspec.Struct):
    backends: list[str]
    devices: list[Device] = []


class _Kept(msgspec.Struct):
    key: str
    backends: list[str]


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    backends = detect()
    found = _Found(backends, detect_devices(backends))
    print(msgspec.json.encode(found).decode(), flush=True)
    sys.stdout.flush()
    # Native engines may spin threads that slow interpreter exit.
    if platform.system() != "Windows":
        import os

        os._exit(0)

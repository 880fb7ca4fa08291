"""Detect the engine backends this machine can really run.

Run as a subprocess (``python -m meshd.engines.probe``) so that importing a native
engine that crashes or hangs cannot take the node down; it prints one JSON list.
A backend is listed only if its engine imports and reports the device; never claimed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import platform
import sys

log = logging.getLogger("meshd.engines")

PROBE_TIMEOUT = 30.0


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
        if int((mx.array([1, 2]) + 1).sum().item()) == 5:
            out.append("mlx-cpu")
    except Exception:
        pass
    return out


def detect() -> list[str]:
    """Backends available in this interpreter (runs engine imports: use :func:`probe`)."""
    return sorted(set(_llama_cpp() + _mlx()))


async def probe(timeout: float = PROBE_TIMEOUT) -> list[str]:
    """Detect backends in a subprocess, bounded by ``timeout``; [] if the probe fails."""
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
        return []
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        log.warning("backend probe timed out after %.0f s; advertising no backends", timeout)
        return []
    try:
        found = json.loads(out.decode().strip().splitlines()[-1])
        return [str(b) for b in found]
    except (ValueError, IndexError):
        log.warning("backend probe printed nothing usable; advertising no backends")
        return []


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    print(json.dumps(detect()), flush=True)
    sys.stdout.flush()
    # Native engines may spin threads that slow interpreter exit.
    if platform.system() != "Windows":
        import os

        os._exit(0)

"""llama.cpp's RPC split for the benchmarks, built from the installed llama-cpp-python's own source.

The llama-cpp-python wheel has no RPC backend. This module fetches the sdist of exactly
the installed version from PyPI (``pip download --no-binary :all:``), builds only what
an RPC split needs from its vendored llama.cpp (``ggml-rpc-server``, the ``ggml-rpc``
backend library and the CPU backend the server runs on, ``GGML_NATIVE`` and without
Intel AMX, as ``install.sh`` builds it here), and ``llama-server``, llama.cpp's own C++
server (bench/compare.py's one-machine anchor), into a cache dir outside the repository
(``$MESHD_BENCH_CACHE``, else ``~/.cache/meshd-bench``). Later runs reuse the build.

The client side is the installed llama-cpp-python itself: :func:`load_rpc_backend`
loads ``libggml-rpc.so`` into the running process (its ``libggml-base.so.0`` resolves to
the copy llama_cpp already loaded), registers one RPC device per server in llama_cpp's
backend registry (``ggml_backend_rpc_add_server`` + ``ggml_backend_register``), and
llama.cpp then offloads the last ``n_gpu_layers`` layers to those devices, as
``llama-cli --rpc`` does. Both ends come from one source
tree, so the RPC protocol versions agree.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import tarfile
import time
from importlib import metadata
from pathlib import Path

CACHE = Path(os.environ.get("MESHD_BENCH_CACHE", Path.home() / ".cache" / "meshd-bench"))
SERVER = "ggml-rpc-server"
#: llama.cpp's own C++ server, the one-machine anchor of bench/compare.py.
LLAMA_SERVER = "llama-server"
TARGETS = (SERVER, "ggml-rpc", "ggml-cpu", LLAMA_SERVER)


def llama_cpp_version() -> str:
    return metadata.version("llama_cpp_python")


def no_amx_flags() -> str:
    """Compiler flags that leave Intel AMX out of a ``-march=native`` build on a CPU
    that has it (its matmul crashes at the first prompt, llama.cpp #20824), as
    ``install.sh`` does for llama-cpp-python; empty elsewhere."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return ""
    return "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if "amx_int8" in flags else ""


def build_dir(version: str | None = None) -> Path:
    # The flags name the dir: a build from before they were set is not reused.
    tag = "-noamx" if no_amx_flags() else ""
    return CACHE / f"llama-cpp-python-{version or llama_cpp_version()}" / f"build{tag}"


def built(version: str | None = None) -> Path | None:
    """The directory holding the server and the backend libraries, when built."""
    b = build_dir(version)
    stamp = b / "meshd-bench-done"
    # A build from before llama-server was a target is finished off, not trusted.
    ok = stamp.exists() and (b / "bin" / LLAMA_SERVER).exists()
    return b / "bin" if ok else None


def ensure_built(log=print, jobs: int = 2) -> Path:
    """Build (once) and return the bin dir with ``ggml-rpc-server`` and the libraries."""
    version = llama_cpp_version()
    done = built(version)
    if done is not None:
        return done
    root = build_dir(version).parent
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        log(f"rpc: fetching the sdist of llama-cpp-python {version} from PyPI")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
             "--no-deps", "--no-binary", ":all:", "-d", str(root)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not src.exists():
        log(f"rpc: unpacking {sdist.name}")
        with tarfile.open(sdist) as tf:
            tf.extractall(root, filter="data")
    build = build_dir(version)
    t0 = time.monotonic()
    out = root / "build.log"
    log(f"rpc: building {', '.join(TARGETS)} in {build} (-j{jobs}, once; log in {out})")
    # The stamp file is written last: an interrupted build never looks finished (the
    # build stays where it is: its binaries carry their RUNPATH).
    no_amx = no_amx_flags()
    flags = [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"] if no_amx else []
    with open(out, "w") as f:
        for cmd in (
            ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *flags,
             "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=OFF", "-DGGML_RPC=ON",
             "-DGGML_CPU=ON", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_COMMON=ON",
             "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"],
            ["cmake", "--build", str(build), "-j", str(jobs), "--target", *TARGETS],
        ):  # fmt: skip
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
            if r.returncode:
                raise RuntimeError(f"{' '.join(cmd[:2])} failed ({r.returncode}); see {out}")
    for name in (SERVER, "libggml-rpc.so", LLAMA_SERVER):
        if not (build / "bin" / name).exists():
            raise RuntimeError(f"the RPC build in {build} has no {name}; see {out}")
    (build / "meshd-bench-done").write_text(version + "\n")
    log(f"rpc: built in {time.monotonic() - t0:.0f} s")
    return build / "bin"


def load_rpc_backend(bin_dir: Path, endpoints: list[str]) -> int:
    """Load ``libggml-rpc.so`` into this process's llama-cpp-python and add one RPC
    device per ``host:port``; returns the number of devices added. Call after
    ``import llama_cpp`` and before ``Llama(...)``."""
    import llama_cpp  # noqa: F401  (loads libggml-base.so.0 and libggml.so.0 first)

    # By soname: the copies llama_cpp's libllama already loaded, so one backend registry.
    ggml = ctypes.CDLL("libggml.so.0")
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_register.restype = None
    base = ctypes.CDLL("libggml-base.so.0")
    base.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    rpc = ctypes.CDLL(str(bin_dir / "libggml-rpc.so"))
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    n = 0
    for ep in endpoints:
        reg = rpc.ggml_backend_rpc_add_server(ep.encode())
        if not reg:
            raise RuntimeError(f"no RPC server answers at {ep}")
        ggml.ggml_backend_register(reg)
        n += int(base.ggml_backend_reg_dev_count(reg))
    return n


def server_command(bin_dir: Path, port: int, threads: int) -> list[str]:
    """``ggml-rpc-server`` on loopback (it serves the CPU backend next to it)."""
    return [str(bin_dir / SERVER), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]


def free_port() -> int:
    import socket

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_main(argv: list[str]) -> None:
    """``python bench/_rpc.py serve HOST:PORT[,HOST:PORT...] [llama_cpp.server options]``:
    llama_cpp.server in this process, with the RPC backend loaded first, so its model
    offloads ``--n_gpu_layers`` layers to those servers."""
    import runpy

    n = load_rpc_backend(ensure_built(log=lambda m: print(m, file=sys.stderr)), argv[0].split(","))
    print(f"rpc: {n} RPC device(s) registered", file=sys.stderr, flush=True)
    sys.argv = ["llama_cpp.server", *argv[1:]]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve_main(sys.argv[2:])
    else:
        print(ensure_built())

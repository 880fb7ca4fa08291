"""The ggml library libllama itself uses, found so that no second copy is mapped, and
the few ggml functions a llama.cpp stage calls through it."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

__all__ = ["Ggml", "cpu_extra_buffer_types", "load_ggml"]


def load_ggml(llama: Any, soname: str = "libggml-base.so.0") -> Any:
    """The ggml library ``soname`` (ggml-base; or libggml, the device registry) that
    libllama itself uses.

    The wheel ships libggml-base under several file names that are copies, not links;
    loading one by path would map a second copy with its own globals (a second
    backend registry, tensors it does not know). Importing llama_cpp has already
    loaded libllama, which pulled ggml in by soname: asking the dynamic loader for that
    soname returns the copy already mapped. Elsewhere, symbols are looked up through
    libllama's own handle, which searches the libraries it loaded.
    """
    if sys.platform.startswith("linux"):
        try:
            return ctypes.CDLL(soname)
        except OSError:
            pass
    return llama.llama_cpp._lib


def cpu_extra_buffer_types(llama: Any) -> list[str]:
    """Names of the extra buffer types of llama.cpp's CPU device in this build (where
    it repacks weights: ``CPU_REPACK``, ``AMX``, ...); empty if the build has none."""
    lib = llama.llama_cpp._lib
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_buft_name.restype = ctypes.c_char_p
    lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    dev = lib.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        return []
    reg = lib.ggml_backend_dev_backend_reg(dev)
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return []
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    names: list[str] = []
    # A NULL-terminated array.
    while bufts and bufts[len(names)]:
        names.append(lib.ggml_backend_buft_name(bufts[len(names)]).decode())
    return names


class Ggml:
    """The few ggml functions the capture callback needs, typed once."""

    def __init__(self, llama: Any) -> None:
        lib = load_ggml(llama)
        self.get_name = lib.ggml_get_name
        self.get_name.restype = ctypes.c_char_p
        self.get_name.argtypes = [ctypes.c_void_p]
        self.nelements = lib.ggml_nelements
        self.nelements.restype = ctypes.c_int64
        self.nelements.argtypes = [ctypes.c_void_p]
        self.nbytes = lib.ggml_nbytes
        self.nbytes.restype = ctypes.c_size_t
        self.nbytes.argtypes = [ctypes.c_void_p]
        self.tensor_get = lib.ggml_backend_tensor_get
        self.tensor_get.restype = None
        self.tensor_get.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
        ]

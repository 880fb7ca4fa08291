"""mlx-lm's model code without its package's start-up.

``import mlx_lm.models.llama`` runs ``mlx_lm/__init__.py`` first, and that imports
mlx-lm's converter, generator and loader and, through their tokenizer, transformers and
huggingface_hub: ~1.7 s of CPU (measured on the 2-core CI machines) and ~100 MB that a
stage never uses (a stage runs its layers; meshd tokenizes with its own vocabulary).
:func:`install` registers the package without running its ``__init__`` until something
asks for a name only that file defines (``mlx_lm.load``, ``mlx_lm.generate``): then it
runs, once, and answers as the plain import would. Submodules (``mlx_lm.models.*``,
``mlx_lm.utils``) import as ever.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

__all__ = ["install", "mlx_core"]


def mlx_core() -> Any:
    """``mlx.core``, with mlx-lm's package start-up made lazy (:func:`install`) first."""
    install()
    import mlx.core as mx

    return mx


def install() -> None:
    """Make ``mlx_lm``'s package start-up lazy in this process (no-op when mlx-lm is
    imported already or not installed)."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not installed: the import that needs it says so
    pkg = importlib.util.module_from_spec(spec)  # __path__ and __spec__ set, not run
    loader = spec.loader

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name not in ("__version__", "__all__"):
            raise AttributeError(name)  # probes (the import system's, inspect's)
        del pkg.__dict__["__getattr__"]  # once: the real names are set from here on
        loader.exec_module(pkg)
        try:
            return pkg.__dict__[name]
        except KeyError:
            raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}") from None

    pkg.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules["mlx_lm"] = pkg

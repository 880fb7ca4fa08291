"""What can be wrong with a model file that is there: errors of format and of fit."""

from __future__ import annotations

__all__ = ["ModelFormatError", "UnsupportedModelError"]


class ModelFormatError(ValueError):
    """The file is not a model this code can read (bad magic, truncated, ...)."""


class UnsupportedModelError(ModelFormatError):
    """A GGUF or folder model that the MLX engine cannot run (architecture, rope,
    quant type)."""

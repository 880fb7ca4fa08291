"""The activation types a hop can carry, by wire name (:mod:`meshd.transport.tensors`
encodes them).

Apart from that module because it is numpy's: the API node checks a requested type
and starts without numpy.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ACTIVATION_DTYPES"]

#: Wire names of the activation types, in the order of preference for exactness.
ACTIVATION_DTYPES: Final = ("f32", "f16", "bf16")

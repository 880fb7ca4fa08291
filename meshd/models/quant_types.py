"""GGUF tensor types: each one's id, name and block layout, those the MLX engine reads
through gguf-py, and the MLX widths they become (:mod:`meshd.models.gguf_dequant`
does the reading).

Constants only: a node reads a model's header (:func:`meshd.models.gguf.read_header`)
and checks whether MLX can run it (:mod:`meshd.models.mlx_layout`) at start, and the
gguf package would bring numpy, yaml and sentencepiece to every node for these tables.
tests/models/test_quant_types.py checks them against the installed gguf-py.
"""

from __future__ import annotations

__all__ = [
    "DEQUANT_TYPES",
    "EXACT_BITS",
    "GGML_TYPES",
    "GROUP_SIZE",
    "PLAIN",
    "REQUANT_BITS",
]

#: Every tensor type of the GGUF format this meshd knows: type id -> (name, values per
#: block, bytes per block), as ggml defines them. A file may hold a newer type: its
#: size then comes from where the next tensor starts (``read_header``).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}

#: MLX group size of every quantized matrix :mod:`meshd.models.gguf_dequant` builds
#: (the smallest MLX supports, and the block of every 32-value GGUF type and of a
#: K-quant's sub-block).
GROUP_SIZE = 32

#: GGUF types repacked without error: type -> MLX bits (the file's own width).
EXACT_BITS: dict[str, int] = {
    "Q4_0": 4,
    "Q4_1": 4,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q8_0": 8,
    "Q4_K": 4,
    "Q5_K": 5,
}

#: GGUF types dequantized by gguf-py and re-quantized by ``mx.quantize``: type -> MLX
#: bits. 8 bits for the 6.5-bit Q6_K; 6 bits for the others (<= 4.5 bits a weight):
#: at the file's own width the MLX grid (not the file's) about doubles the error
#: (measured figures: module docstring).
REQUANT_BITS: dict[str, int] = {
    "Q6_K": 8,
    "Q3_K": 6,
    "Q2_K": 6,
    "IQ4_NL": 6,
    "IQ4_XS": 6,
    "IQ3_S": 6,
    "IQ3_XXS": 6,
    "IQ2_S": 6,
    "IQ2_XS": 6,
    "IQ2_XXS": 6,
    "IQ1_S": 6,
    "IQ1_M": 6,
    "TQ1_0": 6,
    "TQ2_0": 6,
    "MXFP4": 6,
    "NVFP4": 6,
}

#: GGUF float types read as they are.
PLAIN = frozenset({"F32", "F16", "BF16"})

#: Every GGUF tensor type :mod:`meshd.models.gguf_dequant` turns into MLX arrays.
DEQUANT_TYPES = frozenset(PLAIN | EXACT_BITS.keys() | REQUANT_BITS.keys())

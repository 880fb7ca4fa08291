"""meshd's table of GGUF tensor types agrees with the gguf package's (gguf-py, which
llama.cpp keeps in step with ggml)."""

from __future__ import annotations

import gguf

from meshd.models.quant_types import DEQUANT_TYPES, GGML_TYPES


def test_every_type_gguf_py_knows_has_its_id_name_and_block_layout() -> None:
    for qtype in gguf.GGMLQuantizationType:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert GGML_TYPES.get(qtype.value) == (qtype.name, block, size), qtype


def test_every_type_mlx_reads_through_gguf_py_is_a_gguf_type() -> None:
    assert {name for name, _, _ in GGML_TYPES.values()} >= DEQUANT_TYPES

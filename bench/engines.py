"""MLX and mixed pipelines against llama.cpp, decode speed in one run (issue 4 figures).

Runs every configuration in this process on the default model, greedy, and prints
tokens/s and the ratio to the whole-model llama.cpp figure measured in the same run:

* llama.cpp whole model (the baseline)
* MLX whole model, MLX split in 2 stages (in-process chain: engine cost only)
* mixed llama.cpp -> MLX and MLX -> llama.cpp (in-process chain)

In-process chains measure the engines; the network adds ~0.5 ms per hop on loopback
(see bench/inference.py). A benchmark: prints figures, never fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads per stage")
    args = p.parse_args()
    os.environ.setdefault("MESHD_THREADS", str(args.threads))

    from meshd.engines.llama_stage import LlamaStage
    from meshd.engines.mlx_stage import MlxStage
    from meshd.engines.stage import StageInput
    from meshd.engines.threads import configure_threads
    from meshd.models.hashing import file_sha256
    from meshd.models.resolve import DEFAULT_MODEL, resolve_model
    from meshd.models.slicing import slice_gguf

    configure_threads()
    path = Path(resolve_model(DEFAULT_MODEL).path)
    cache = Path(tempfile.mkdtemp(prefix="meshd-bench-engines-"))
    sha = file_sha256(path, cache)
    n, half = 30, 15

    def llama(a: int, b: int):
        return LlamaStage(slice_gguf(path, a, b, cache, sha), first=a == 0, last=b == n,
                          n_ctx=512, n_seq_max=1, n_threads=args.threads)  # fmt: skip

    def mlx(a: int, b: int):
        return MlxStage(path, start=a, end=b, first=a == 0, last=b == n, n_ctx=512, n_seq_max=1)

    configs = {
        "llama.cpp whole": lambda: [llama(0, n)],
        "MLX whole": lambda: [mlx(0, n)],
        "MLX 2 stages": lambda: [mlx(0, half), mlx(half, n)],
        "llama.cpp -> MLX": lambda: [llama(0, half), mlx(half, n)],
        "MLX -> llama.cpp": lambda: [mlx(0, half), llama(half, n)],
    }

    def decode_rate(chain) -> float:
        prompt = chain[0].tokenize("Once upon a time", add_special=True, parse_special=False)
        cur, pos = np.asarray(prompt, np.int32), 0
        t0 = None
        for i in range(args.tokens + 1):
            x = chain[0].forward([StageInput(seq=0, pos=pos, tokens=cur)])[0]
            for st in chain[1:]:
                x = st.forward([StageInput(seq=0, pos=pos, hidden=x)])[0]
            pos += len(cur)
            cur = np.array([int(np.argmax(x))], np.int32)
            if i == 0:
                t0 = time.perf_counter()  # decode only: after the prefill's token
        for st in chain:
            st.free(0)
        return args.tokens / (time.perf_counter() - t0)  # type: ignore[operator]

    chains = {name: make() for name, make in configs.items()}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):  # interleaved, so load drifts hit every config alike
        for name, chain in chains.items():
            rates[name].append(decode_rate(chain))
    base = statistics.median(rates["llama.cpp whole"])
    load = os.getloadavg()[0]
    print(
        f"decode, {args.tokens} tokens greedy, median of {args.repeats} (min-max), "
        f"llama.cpp threads per stage: {args.threads}, load {load:.2f}"
    )
    print(f"{'configuration':<20} {'tok/s':>8} {'spread':>15} {'/ llama.cpp whole':>18}")
    for name, rs in rates.items():
        med = statistics.median(rs)
        print(f"{name:<20} {med:8.1f} {min(rs):7.1f}-{max(rs):<7.1f} {med / base:18.3f}")
    for chain in chains.values():
        for st in chain:
            st.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a cut costs the engine, per architecture: whole model vs 2 stages, in-process.

    python bench/architectures.py                   # 64 greedy tokens, median of 3
    python bench/architectures.py --tokens 128 --repeat 5 --threads 1

For each architecture of the matrix in ``tests/engines/test_architectures.py``, a small
synthetic GGUF (random weights, the default model's tokenizer) is written to a temporary
dir and run greedy with llama.cpp's default path (``exact=False``, n_ctx 256): once as
one ``LlamaStage``, once cut in the middle into two stages whose hidden rows are handed
from one to the next in this process. After a short prompt's prefill, ``--tokens``
decode steps are timed; whole and split alternate within each repeat, so drift hits
both alike. Prints decode tok/s (median and min-max) and the paired split/whole ratio:
the engine's cost of a cut, without any network (see bench/hop.py for that).

A benchmark, not a test: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import Series, cpu_model, log, med, paired, run_measure, spread, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Once upon a time there was a little girl who lived in a village near the forest"


def decode_rate(chain: list[Any], prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Decode tok/s of greedy steps through ``chain`` after the prompt's prefill, and
    the tokens it chose."""
    from meshd.engines.stage import StageInput

    cur, pos, out = np.asarray(prompt, np.int32), 0, []
    t0 = 0.0
    for i in range(tokens + 1):
        x = chain[0].forward([StageInput(seq=0, pos=pos, tokens=cur)])[0]
        for st in chain[1:]:
            x = st.forward([StageInput(seq=0, pos=pos, hidden=x)])[0]
        pos += len(cur)
        out.append(int(np.argmax(x)))
        cur = np.array([out[-1]], np.int32)
        if i == 0:
            t0 = time.perf_counter()  # decode only: from the prefill's token on
    dt = time.perf_counter() - t0
    for st in chain:
        st.free(0)
    return tokens / dt, out


def measure(tmp: Path, args: argparse.Namespace) -> int:
    from meshd.engines.llama_stage import LlamaStage
    from meshd.engines.threads import configure_threads
    from meshd.models.hashing import file_sha256
    from meshd.models.resolve import DEFAULT_MODEL, resolve_model
    from meshd.models.slicing import slice_gguf
    from tests.engines.test_architectures import MATRIX
    from tests.synthetic import N_LAYERS, write_model

    configure_threads()
    tokenizer = Path(resolve_model(DEFAULT_MODEL).path)
    cut = N_LAYERS // 2

    def stage(p: Path, first: bool, last: bool) -> Any:
        return LlamaStage(p, first=first, last=last, n_ctx=256, n_seq_max=1,
                          n_threads=args.threads)  # fmt: skip

    rows: list[list[str]] = []
    n_prompt = 0
    for case, (arch, opts, meta) in MATRIX.items():
        log(f"{case}: {arch}")
        path = write_model(tmp / f"{case}.gguf", tokenizer, arch, metadata=meta, **opts)
        sha = file_sha256(path)
        a, b = (slice_gguf(path, s, e, tmp / "slices", sha) for s, e in ((0, cut), (cut, N_LAYERS)))
        chains = {"whole": [stage(path, True, True)],
                  "split": [stage(a, True, False), stage(b, False, True)]}  # fmt: skip
        try:
            prompt = chains["whole"][0].tokenize(PROMPT, add_special=True, parse_special=False)
            n_prompt = len(prompt)
            if len(prompt) + args.tokens + 1 > 256:
                raise ValueError(f"--tokens {args.tokens} does not fit n_ctx 256")
            for chain in chains.values():
                decode_rate(chain, prompt, 4)  # warm up
            rates: dict[str, list[float]] = {k: [] for k in chains}
            toks: dict[str, list[int]] = {}
            for _ in range(args.repeat):
                for k, chain in chains.items():
                    r, toks[k] = decode_rate(chain, prompt, args.tokens)
                    rates[k].append(r)
        finally:
            for st in itertools.chain(*chains.values()):
                st.close()
        ratios = paired(Series("split", xs=rates["split"]), Series("whole", xs=rates["whole"]))
        rows.append([
            case, f"{med(rates['whole']):.1f}", spread(rates["whole"], "{:.1f}"),
            f"{med(rates['split']):.1f}", spread(rates["split"], "{:.1f}"),
            f"{med(ratios):.3f}", "yes" if toks["split"] == toks["whole"] else "no",
        ])  # fmt: skip
    print()
    print(f"decode, {args.tokens} greedy tokens after a {n_prompt}-token prompt, median of "
          f"{args.repeat} (min-max); exact=False, n_ctx 256, cut at layer {cut}/{N_LAYERS}; "
          f"threads per stage {args.threads or 'default'}; {cpu_model()}, "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    header = ["architecture", "whole tok/s", "min-max", "2-stage tok/s", "min-max",
              "split/whole", "same tokens"]  # fmt: skip
    print(table(rows, header))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--repeat", type=int, default=3, help="runs per side (median)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads per stage")
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary GGUFs")
    args = p.parse_args()
    return run_measure("meshd-bench-arch-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    raise SystemExit(main())

"""What a cut costs the engine, per architecture: whole model vs 2 stages, in-process.

    python bench/architectures.py                   # 64 greedy tokens, median of 3
    python bench/architectures.py --tokens 128 --repeat 5 --threads 1

For each architecture issue #32 added to the matrix in
``tests/engines/test_architectures.py`` (``--all``: every case of it), a small
synthetic GGUF (random weights, the default model's tokenizer) is written to a temporary
dir and run greedy with llama.cpp's default path (``exact=False``, n_ctx 256): once as
one ``LlamaStage``, once cut in two where the matrix cuts it (a cut placement may take:
a hybrid's stages each hold both kinds of layer, smollm3 and llama4 are cut at a
multiple of 4) into two stages whose hidden rows are handed from one to the next in
this process. After a short prompt's prefill, ``--tokens``
decode steps are timed; whole and split alternate within each repeat, so drift hits
both alike. Prints decode tok/s (median and min-max) and the paired split/whole ratio:
the engine's cost of a cut, without any network (see bench/hop.py for that). Then the
matrix's own figure: the largest |logit difference| of whole against 2 and 3 stages in
exact mode (``inf`` if their tokens differ).

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


def logit_gap(model: Path, n_layers: int, cuts: dict[int, tuple[int, ...]], tmp: Path) -> float:
    """The matrix's figure (tests/engines/test_architectures.py): the largest |logit
    difference| of 8 greedy steps in exact mode, whole against 2 and 3 stages (inf
    when the tokens differ)."""
    from meshd.engines.llama_stage import LlamaStage
    from meshd.models.hashing import file_sha256
    from meshd.models.slicing import slice_gguf
    from tests.engines.chains import greedy, worst

    def chain(bounds: list[int]) -> list[Any]:
        parts = [(a, b, slice_gguf(model, a, b, tmp / "slices", file_sha256(model)))
                 for a, b in itertools.pairwise(bounds)]  # fmt: skip
        return [LlamaStage(p, first=a == 0, last=b == n_layers, n_ctx=256, n_seq_max=1,
                           exact=True) for a, b, p in parts]  # fmt: skip

    gap = 0.0
    whole = chain([0, n_layers])
    try:
        prompt = whole[0].tokenize(PROMPT, add_special=False, parse_special=False)
        one, one_logits = greedy(whole, prompt, 8)
        for k in (2, 3):
            stages = chain([0, *cuts[k], n_layers])
            try:
                tokens, logits = greedy(stages, prompt, 8)
            finally:
                for st in stages:
                    st.close()
            gap = max(gap, worst(one_logits, logits) if tokens == one else float("inf"))
    finally:
        whole[0].close()
    return gap


def write_case(case: str, tmp: Path, tokenizer: Path) -> tuple[Path, int]:
    """The matrix case's synthetic GGUF and its layer count."""
    from tests.engines.test_architectures import CASES, MATRIX
    from tests.synthetic import write_model
    from tests.synthetic_archs import ARCHS, write_arch

    path = tmp / f"{case}.gguf"
    if case in ARCHS:
        return write_arch(path, tokenizer, case), CASES[case][1]
    arch, opts, meta = MATRIX[case]
    return write_model(path, tokenizer, arch, metadata=meta, **opts), CASES[case][1]


def measure(tmp: Path, args: argparse.Namespace) -> int:
    from meshd.engines.llama_stage import LlamaStage
    from meshd.engines.threads import configure_threads
    from meshd.models.hashing import file_sha256
    from meshd.models.resolve import DEFAULT_MODEL, resolve_model
    from meshd.models.slicing import slice_gguf
    from tests.engines.test_architectures import CASES, CUTS
    from tests.synthetic_archs import ARCHS

    configure_threads()
    tokenizer = Path(resolve_model(DEFAULT_MODEL).path)

    def stage(p: Path, first: bool, last: bool) -> Any:
        return LlamaStage(p, first=first, last=last, n_ctx=256, n_seq_max=1,
                          n_threads=args.threads)  # fmt: skip

    cases = args.cases or (list(CASES) if args.all else list(ARCHS))
    rows: list[list[str]] = []
    n_prompt = 0
    for case in cases:
        log(f"{case}: {CASES[case][0]}")
        path, n_layers = write_case(case, tmp, tokenizer)
        (cut,) = CUTS[n_layers][2]  # where the matrix cuts it in two (a cut it may take)
        sha = file_sha256(path)
        a, b = (slice_gguf(path, s, e, tmp / "slices", sha) for s, e in ((0, cut), (cut, n_layers)))
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
        gap = logit_gap(path, n_layers, CUTS[n_layers], tmp)
        ratios = paired(Series("split", xs=rates["split"]), Series("whole", xs=rates["whole"]))
        # Each case's figures as they come: a run cut short keeps what it measured.
        log(f"{case}: split/whole {med(ratios):.3f}, max |dlogit| {gap:.2g}")
        rows.append([
            case, f"{med(rates['whole']):.1f}", spread(rates["whole"], "{:.1f}"),
            f"{med(rates['split']):.1f}", spread(rates["split"], "{:.1f}"),
            f"{med(ratios):.3f}", "yes" if toks["split"] == toks["whole"] else "no",
            f"{cut}/{n_layers}", f"{gap:.2g}",
        ])  # fmt: skip
    print()
    print(f"decode, {args.tokens} greedy tokens after a {n_prompt}-token prompt, median of "
          f"{args.repeat} (min-max); exact=False, n_ctx 256, cut where the matrix cuts in two; "
          f"threads per stage {args.threads or 'default'}; {cpu_model()}, "
          f"load {os.getloadavg()[0]:.2f}. max |dlogit|: the matrix's figure, exact mode, "
          "whole vs 2 and 3 stages, 8 greedy steps")  # fmt: skip
    header = ["architecture", "whole tok/s", "min-max", "2-stage tok/s", "min-max",
              "split/whole", "same tokens", "cut", "max |dlogit|"]  # fmt: skip
    print(table(rows, header))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--repeat", type=int, default=3, help="runs per side (median)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads per stage")
    p.add_argument("--all", action="store_true", help="every case of the matrix")
    p.add_argument("--cases", nargs="+", help="these cases of the matrix, in this order")
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary GGUFs")
    args = p.parse_args()
    return run_measure("meshd-bench-arch-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    raise SystemExit(main())

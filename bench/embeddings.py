"""Embedding throughput: meshd (one node, one stage) against llama-cpp-python's ``embed``.

    python bench/embeddings.py                # 3 repeats of a 64-input batch
    python bench/embeddings.py --repeats 5 --inputs 128 --model PATH

Both embed the same batch of short texts (10-40 tokens each) from the same GGUF (the
default model unless ``--model``): meshd through ``POST /v1/embeddings`` with the whole
batch in one request (the official ``openai`` client's shape), llama-cpp-python in
process (``Llama(embedding=True, pooling_type=MEAN).embed(batch, normalize=True)``,
the same vectors). Repeats alternate the two, and the figure is the paired ratio of
inputs per second, meshd / llama-cpp-python (goal: >= 0.9). It also prints the mean
cosine between the two sets of vectors.

A benchmark, not a test: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from _common import (
    DEFAULT_MODEL,
    N_CTX,
    Figure,
    Series,
    cpu_model,
    http_client,
    log,
    paired,
    place,
    print_pair,
    run_measure,
    start_node,
    version,
)

_TEXT = (
    "the quick brown fox jumps over a lazy dog while rain falls on the quiet town and "
    "children read old books about ships stars gardens and distant mountains"
)
WORDS = _TEXT.split()


def _batch(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, int(rng.integers(8, 30)))) for _ in range(n)]


def measure(tmp: Path, args: argparse.Namespace) -> int:
    import llama_cpp

    from meshd.models.resolve import resolve_model

    path = str(resolve_model(args.model).path)
    batch = _batch(args.inputs)
    client = http_client()
    node = start_node(tmp, "a", "bench-embeddings", extra=args.node_args)
    place(client, node, args.model, ["a"])
    ref = llama_cpp.Llama(
        path, embedding=True, verbose=False, n_ctx=N_CTX, n_batch=N_CTX,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    )  # fmt: skip
    body = {"model": args.model, "input": batch, "encoding_format": "float"}

    def meshd() -> np.ndarray:
        r = client.post(node.api + "/v1/embeddings", json=body)
        r.raise_for_status()
        return np.array([d["embedding"] for d in r.json()["data"]])

    def direct() -> np.ndarray:
        return np.asarray(ref.embed(batch, normalize=True))

    ours, theirs = Series("meshd", "inputs/s"), Series("llama-cpp-python", "inputs/s")
    a, b = meshd(), direct()  # warm both (the embeddings context is made on first use)
    cosine = float(np.mean(np.sum(a * b, axis=1)))
    for rep in range(args.repeats):
        for series, fn in ((ours, meshd), (theirs, direct)):
            t0 = time.perf_counter()
            fn()
            series.xs.append(len(batch) / (time.perf_counter() - t0))
        log(f"repeat {rep + 1}/{args.repeats}: meshd {ours.xs[-1]:.1f} inputs/s, "
            f"llama-cpp-python {theirs.xs[-1]:.1f} inputs/s")  # fmt: skip
    fig = Figure(
        "meshd / llama-cpp-python inputs/s",
        paired(ours, theirs),
        ">= 0.9",
        lambda v: v >= 0.9,
        note=f"{len(batch)} inputs, mean cosine {cosine:.5f}",
    )
    print_pair(
        f"model {args.model}; {cpu_model()}; llama-cpp-python {version('llama-cpp-python')}",
        (ours, theirs), "embedder", "{:.1f}", fig,
    )  # fmt: skip
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--node-args", nargs="*", default=[], help="extra `meshd up` arguments")
    args = p.parse_args()
    return run_measure("meshd-bench-embeddings-", args.keep_logs, lambda t: measure(t, args))


if __name__ == "__main__":
    sys.exit(main())

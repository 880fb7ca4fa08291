"""What each API dialect costs over OpenAI's chat completions, on one node.

    python bench/dialects.py                 # 5 repeats of 64 greedy tokens each
    python bench/dialects.py --repeats 9 --tokens 128 --model PATH

The same greedy request (same prompt, same length) is streamed through
``/v1/chat/completions`` (the baseline), ``/api/chat`` (Ollama, NDJSON),
``/v1/messages`` (Anthropic) and ``/v1/responses`` (OpenAI Responses), in turn within
each repeat, with a raw HTTP client timing the whole stream. Every dialect must give
the baseline's text. The figures are the paired ratios of tokens per second,
dialect / chat completions (goal: >= 0.95: an adapter only renders events).

A benchmark, not a test: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from _common import (
    DEFAULT_MODEL,
    PROMPT,
    Figure,
    Series,
    cpu_model,
    http_client,
    log,
    med,
    paired,
    place,
    run_measure,
    spread,
    start_node,
    table,
)

MESSAGES = [{"role": "user", "content": PROMPT}]


def _sse_data(r: httpx.Response) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in r.iter_lines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _openai(d: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in d if c["choices"])


def _anthropic(d: list[dict]) -> str:
    return "".join(e["delta"]["text"] for e in d if e["type"] == "content_block_delta")


def _responses(d: list[dict]) -> str:
    return "".join(e["delta"] for e in d if e["type"] == "response.output_text.delta")


def measure(tmp: Path, args: argparse.Namespace) -> int:
    client = http_client()
    node = start_node(tmp, "a", "bench-dialects", extra=args.node_args)
    place(client, node, args.model, ["a"])
    n, model = args.tokens, args.model
    # route, body, how to read the stream's text
    dialects: dict[str, tuple[str, dict, Callable[[httpx.Response], str]]] = {
        "chat completions": (
            "/v1/chat/completions",
            {"model": model, "messages": MESSAGES, "max_tokens": n, "temperature": 0,
             "stream": True},
            lambda r: _openai(_sse_data(r)),
        ),
        "ollama /api/chat": (
            "/api/chat",
            {"model": model, "messages": MESSAGES, "stream": True,
             "options": {"num_predict": n, "temperature": 0}},
            lambda r: "".join(json.loads(ln)["message"]["content"] for ln in r.iter_lines() if ln),
        ),
        "anthropic /v1/messages": (
            "/v1/messages",
            {"model": model, "messages": MESSAGES, "max_tokens": n, "temperature": 0,
             "stream": True},
            lambda r: _anthropic(_sse_data(r)),
        ),
        "openai /v1/responses": (
            "/v1/responses",
            {"model": model, "input": PROMPT, "max_output_tokens": n, "temperature": 0,
             "stream": True},
            lambda r: _responses(_sse_data(r)),
        ),
    }  # fmt: skip

    def run(name: str) -> tuple[str, float]:
        path, body, read = dialects[name]
        t0 = time.perf_counter()
        with client.stream("POST", node.api + path, json=body) as r:
            r.raise_for_status()
            text = read(r)
        return text, time.perf_counter() - t0

    series = {name: Series(name) for name in dialects}
    reference, _ = run("chat completions")  # warm-up, and the text every dialect must give
    for name in dialects:
        text, _ = run(name)
        if text != reference:
            log(f"{name} gave another text than chat completions:\n{text!r}\n{reference!r}")
            return 1
    for rep in range(args.repeats):
        for name in dialects:
            _, took = run(name)
            series[name].xs.append(n / took)
        log(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(
            f"{s.label} {s.xs[-1]:.1f}" for s in series.values()))  # fmt: skip
    base = series["chat completions"]
    print()
    print(f"model {model}; {cpu_model()}; {n} greedy tokens streamed, {args.repeats} repeats")
    print(table([[s.label, f"{med(s.xs):.1f}", spread(s.xs, "{:.1f}")] for s in series.values()],
                ["route", "tok/s (median)", "min-max"]))  # fmt: skip
    print()
    figs = [
        Figure(f"{name} / chat completions tok/s", paired(s, base), ">= 0.95",
               lambda v: v >= 0.95).row()
        for name, s in series.items() if s is not base
    ]  # fmt: skip
    print(table(figs, ["figure", "median", "min-max", "goal", "", "note"]))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--node-args", nargs="*", default=[], help="extra `meshd up` arguments")
    args = p.parse_args()
    return run_measure("meshd-bench-dialects-", args.keep_logs, lambda t: measure(t, args))


if __name__ == "__main__":
    sys.exit(main())

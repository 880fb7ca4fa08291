"""What a JSON schema costs per token: constrained decoding against free decoding.

    python bench/constrained.py               # 3 repeats of 8 prompts
    python bench/constrained.py --repeats 5 --model PATH

One meshd node on loopback serves the model (the default one unless ``--model``) as one
stage. Each prompt is sent twice per repeat, back to back: free (``ignore_eos``, 64
tokens) and with a ``json_schema`` response format (until the JSON closes). Both stream
under the same sampling (the server's defaults, one seed), and the figure is the paired
ratio of decode time per token, constrained / free, timed at the client from the first
token to the last (goal: <= 1.10; the mask is computed on the last stage while the
engine is idle, so its cost adds to each token's).

A benchmark, not a test: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _common import (
    DEFAULT_MODEL,
    Figure,
    Series,
    cpu_model,
    http_client,
    log,
    med,
    paired,
    place,
    print_pair,
    run_measure,
    start_node,
    stream_chat,
    version,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 60},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "married"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a retired teacher from Lyon.",
    "Invent a character for a mystery novel.",
    "Tell me about a sailor from Lisbon.",
    "Describe my neighbour, who loves gardening.",
    "Write a profile of a young chess champion.",
    "Describe a baker who wakes up at 4 am.",
    "Introduce a student in Tokyo.",
    "Describe a famous chef.",
]


def _payload(model: str, prompt: str, constrained: bool, seed: int) -> dict:
    p: dict = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": seed,
    }
    if constrained:
        p["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        }
    else:
        p["max_tokens"] = 64
        p["ignore_eos"] = True
    return p


def measure(tmp: Path, args: argparse.Namespace) -> int:
    client = http_client()
    node = start_node(tmp, "a", "bench-constrained", extra=args.node_args)
    place(client, node, args.model, ["a"])
    free, held = Series("free", "ms/token"), Series("json_schema", "ms/token")
    # Warm up both paths (the first constrained request reads the vocabulary).
    for constrained in (False, True):
        stream_chat(client, node.api, _payload(args.model, PROMPTS[0], constrained, 0))
    for rep in range(args.repeats):
        for i, prompt in enumerate(PROMPTS):
            seed = 1000 * rep + i
            for series, constrained in ((free, False), (held, True)):
                s = stream_chat(client, node.api, _payload(args.model, prompt, constrained, seed))
                series.xs.append(1000.0 / s.decode_tok_s)
        log(f"repeat {rep + 1}/{args.repeats}: free {med(free.xs):.2f} ms/token, "
            f"json_schema {med(held.xs):.2f} ms/token")  # fmt: skip
    fig = Figure(
        "constrained / free ms per token",
        paired(held, free),
        "<= 1.10",
        lambda v: v <= 1.10,
        note=f"{len(PROMPTS)} prompts x {args.repeats}",
    )
    print_pair(
        f"model {args.model}; {cpu_model()}; llguidance {version('llguidance')}",
        (free, held), "decoding", "{:.2f}", fig,
    )  # fmt: skip
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--node-args", nargs="*", default=[], help="extra `meshd up` arguments")
    args = p.parse_args()
    return run_measure("meshd-bench-constrained-", args.keep_logs, lambda t: measure(t, args))


if __name__ == "__main__":
    sys.exit(main())

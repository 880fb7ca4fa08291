"""Turn 2 of a long chat as a client sends it (no cache_prompt field), against turn 1.

    python bench/prefix.py                    # 1 stage, 3 repeats
    python bench/prefix.py --stages 2 --repeat 5

Real ``meshd up`` processes on loopback (one per stage, secured, no discovery) serve
the default model, placed over them. Each repeat is a conversation of its own (a
different long text, about ``--words`` words: ~1,500 tokens at the default, 1450): turn 1
asks for a short answer about the text, turn 2 sends the whole history plus one more
question. Requests are greedy (``temperature: 0``, as coding agents send) and, like
every OpenAI or Anthropic client, say nothing of ``cache_prompt``: the default reuses
turn 1's KV. Turn 2 is timed twice, in alternating order, as sent (the default) and
with ``exact: true`` (the exact mode: computed whole, on a cold runner). Printed:
median time to first token of turn 1, of turn 2 as sent and of turn 2 exact, the
ratios to turn 1 measured in the same run (goal: turn 2 as sent / turn 1 <= 0.1) and
how many prompt tokens the cache gave (the usage's
``prompt_tokens_details.cached_tokens``). A benchmark: it prints figures and exits 0
whatever they are.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from _common import http_client, log, med, place, run_measure, spread, start_node, table

from meshd.models.resolve import DEFAULT_MODEL

GOAL = 0.1
WORDS = [
    "river", "stone", "lantern", "orchard", "harbor", "meadow", "copper", "violin",
    "winter", "garden", "bridge", "market", "candle", "library", "mountain", "ferry",
]  # fmt: skip


def long_text(seed: int, words: int) -> str:
    """A text of ``words`` words, its own for each seed (no two repeats share it)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def ttft(
    client: Any, api: str, messages: list[dict[str, str]], **extra: Any
) -> tuple[float, dict, str]:
    """Time to the first streamed token, the final usage, and the answer's text."""
    body = {
        "model": DEFAULT_MODEL, "messages": messages, "stream": True, "max_tokens": 16,
        "temperature": 0, "stream_options": {"include_usage": True}, **extra,
    }  # fmt: skip
    t0 = time.perf_counter()
    first = 0.0
    usage: dict = {}
    text = []
    with client.stream("POST", api + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            obj = json.loads(line[5:])
            choices = obj.get("choices") or []
            piece = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
            if piece and not first:
                first = time.perf_counter() - t0
            text.append(piece)
            usage = obj.get("usage") or usage
    return first, usage, "".join(text)


def measure(tmp: Path, args: argparse.Namespace) -> int:
    nodes = []
    for i in range(args.stages):
        nodes.append(start_node(tmp, f"n{i}", "prefix", peers=nodes[:1]))
    client = http_client()
    place(client, nodes[0], DEFAULT_MODEL, [n.name for n in nodes])
    api = nodes[0].api
    turn1, cached, fresh, reused, n_prompt = [], [], [], [], []
    exact = {"exact": True}
    for rep in range(args.repeat):
        text = long_text(rep, args.words)
        first = [{"role": "user", "content": f"{text}\n\nWhich word comes first?"}]
        # As a client sends it: a new conversation finds nothing kept but the chat
        # template's first few tokens.
        t1, u1, answer = ttft(client, api, first)
        history = [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And which word comes last?"},
        ]
        # Alternate the order. An exact request runs cold (every kept prefix dropped
        # first), so after it turn 1 runs again to be kept for the request as sent.
        if rep % 2:
            tf, _, _ = ttft(client, api, history, **exact)
            ttft(client, api, first)
            tc, uc, _ = ttft(client, api, history)
        else:
            tc, uc, _ = ttft(client, api, history)
            tf, _, _ = ttft(client, api, history, **exact)
        turn1.append(t1)
        cached.append(tc)
        fresh.append(tf)
        reused.append((uc.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        n_prompt.append(uc.get("prompt_tokens", 0))
        log(f"repeat {rep + 1}: turn 1 {t1:.3f} s ({u1.get('prompt_tokens')} tokens), "
            f"turn 2 as sent {tc:.3f} s ({reused[-1]}/{n_prompt[-1]} from the cache), "
            f"exact {tf:.3f} s")  # fmt: skip
    rows = [
        ["turn 1 (as sent)", spread(turn1), "1.00"],
        ["turn 2, exact (computed whole)", spread(fresh), f"{med(fresh) / med(turn1):.2f}"],
        ["turn 2, as sent (prefix reused)", spread(cached), f"{med(cached) / med(turn1):.2f}"],
    ]
    print(
        f"\ngreedy chat, no cache_prompt field, {args.stages} stage(s), {args.repeat} "
        f"conversations, turn 2 prompts of {med(n_prompt):.0f} tokens, {med(reused):.0f} "
        "from the cache"
    )
    print(table(rows, ["time to first token", "seconds (median [min-max])", "x turn 1"]))
    ratio = med(cached) / med(turn1)
    print(f"turn 2 as sent / turn 1 = {ratio:.2f} (goal <= {GOAL}); "
          f"turn 2 as sent / exact = {med(cached) / med(fresh):.2f}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=1, help="nodes the model is split over")
    p.add_argument("--repeat", type=int, default=3, help="conversations (default 3)")
    p.add_argument("--words", type=int, default=1450, help="words of the long text")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    return run_measure("meshd-prefix-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    sys.exit(main())

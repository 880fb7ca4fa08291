"""Decode speed with and without speculative decoding (prompt lookup), 1 and 2 stages.

    python bench/speculate.py                  # 1 and 2 stages, 3 repeats
    python bench/speculate.py --stages 2 --repeat 5

Real ``meshd up`` processes on loopback (one per stage, secured, no discovery) serve
the default model placed over them. Two prompt sets: **code edit** (the model is asked
to repeat a function with one name changed: its answer quotes its input) and **chat**
(a free answer: little repeats). Every request is greedy with a fixed length
(``ignore_eos``) and says ``speculate`` true or false, alternating which goes first.
Printed per set and stage count: median decode tok/s of each, their ratio, and the
share of drafted tokens accepted (from ``/metrics``). On loopback the ring trip is
~1 ms; over a LAN the trip, not the compute, sets the speed and the ratio grows (see
bench/README.md). A benchmark: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _common import (
    chat_payload,
    counted,
    http_client,
    log,
    med,
    place,
    run_measure,
    scrape,
    start_node,
    stream_chat,
    table,
)

from meshd.models.resolve import DEFAULT_MODEL

CODE = '''def total_price(items, tax_rate):
    """Sum the prices of items and add tax."""
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
SETS = {
    "code edit": f"Rewrite this function with `subtotal` renamed to `net`. "
    f"Answer with the code only.\n\n{CODE}",
    "chat": "Tell me about the history of tea in a few paragraphs.",
}


def measure(tmp: Path, args: argparse.Namespace) -> int:
    rows = []
    for stages in args.stages:
        nodes = []
        for i in range(stages):
            nodes.append(start_node(tmp, f"s{stages}n{i}", f"spec{stages}", peers=nodes[:1]))
        client = http_client()
        place(client, nodes[0], DEFAULT_MODEL, [n.name for n in nodes])
        api = nodes[0].api
        for name, prompt in SETS.items():
            speeds: dict[bool, list[float]] = {False: [], True: []}
            before = scrape(client, nodes[0])
            for rep in range(args.repeat):
                for spec in (rep % 2 == 0, rep % 2 == 1):
                    p = chat_payload(DEFAULT_MODEL, args.tokens, meshd=True,
                                     messages=[{"role": "user", "content": prompt}])  # fmt: skip
                    p["speculate"] = spec
                    s = stream_chat(client, api, p)
                    speeds[spec].append(s.decode_tok_s)
                    log(f"{stages} stage(s), {name}, speculate={spec}: {s.decode_tok_s:.1f} tok/s")
            after = scrape(client, nodes[0])
            drafted = counted(before, after, "meshd_draft_tokens_total")
            accepted = counted(before, after, "meshd_draft_tokens_accepted_total")
            share = f"{accepted / drafted:.0%} of {drafted:.0f}" if drafted else "-"
            plain, spec_s = med(speeds[False]), med(speeds[True])
            rows.append([str(stages), name, f"{plain:.1f}", f"{spec_s:.1f}",
                         f"{spec_s / plain:.2f}", share])  # fmt: skip
        for n in nodes:
            n.proc.stop()
    print(f"\nspeculative decoding (prompt lookup), {args.tokens} tokens, "
          f"{args.repeat} repeats, median decode tok/s")  # fmt: skip
    print(table(rows, ["stages", "prompts", "plain", "speculate", "ratio", "accepted"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    return run_measure("meshd-spec-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    sys.exit(main())

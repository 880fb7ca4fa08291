"""What splitting thoughts from the answer costs the last stage, per token.

    python bench/reasoning.py                 # 5 repeats of 20,000 tokens per case
    python bench/reasoning.py --tokens 50000 --repeats 9

Each token's text goes through what the last stage runs for a thinking model
(``meshd.engines.runner.thinking.ThoughtTrack``: the streaming parser, the count of
thought tokens, the budget check and the grammar's wait), in process, on token-sized
pieces of a text (the default model's tokenizer gives ~4 characters a token on
English prose). Cases: a model that does not think (no track: the path every request
took before), thoughts between ``<think>`` tags (every token inside them, the held
blanks and the partial close tag checked), the answer after them, and gpt-oss's
harmony messages. The figure to read is microseconds per token against a decode step
of the default model (~12 ms on one CPU core: goal <= 2%, 240 us).

A benchmark, not a test: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from meshd.domain.reasoning import Thinking
from meshd.engines.runner.thinking import ThoughtTrack

PROSE = (
    "The user asks for the weather in Paris. I should call the tool, then read its "
    "result back and answer in one short sentence, with the temperature in Celsius. "
)
STEP_MS = 12.0


def pieces(text: str, n: int, width: int = 4) -> list[str]:
    """``n`` token-sized pieces of ``text`` repeated."""
    out, at = [], 0
    while len(out) < n:
        if at + width > len(text):
            at = 0
        out.append(text[at : at + width])
        at += width
    return out


def case_none(tokens: list[str]) -> Callable[[], None]:
    def run() -> None:
        for _ in tokens:  # the loop alone: a request with no track runs nothing more
            pass

    return run


def case_track(thinking: Thinking, head: list[str], tokens: list[str]) -> Callable[[], None]:
    def run() -> None:
        track = ThoughtTrack(thinking, [], None)
        for t in head:
            track.split(t)
        for t in tokens:
            track.split(t)
            track.grammar_now()

    return run


def timed(run: Callable[[], None], n: int, repeats: int) -> tuple[float, float]:
    """Median and spread (max - min) of microseconds of CPU per token: the process's
    own CPU time, which other processes on the cores (a busy machine) do not add to."""
    us = []
    for _ in range(repeats):
        t0 = time.process_time()
        run()
        us.append((time.process_time() - t0) / n * 1e6)
    return statistics.median(us), max(us) - min(us)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    n = a.tokens
    body = pieces(PROSE, n)
    think = Thinking(format="think", close=[1])
    harmony = Thinking(format="harmony", close=[1])
    cases = {
        "no thinking (no track)": case_none(body),
        "thoughts (<think> ... )": case_track(think, ["<think>", "\n"], body),
        "answer after </think>": case_track(think, ["<think>", "x", "</think>", "\n\n"], body),
        "thoughts opened by the prompt": case_track(
            Thinking(format="think", open=True, close=[1]), [], body
        ),
        "harmony analysis": case_track(harmony, ["<|channel|>", "analysis", "<|message|>"], body),
        "harmony final": case_track(harmony, ["<|channel|>", "final", "<|message|>"], body),
    }
    print(f"{n} tokens of ~4 characters, {a.repeats} repeats; goal <= 2% of a "
          f"{STEP_MS:g} ms decode step ({STEP_MS * 20:.0f} us)")  # fmt: skip
    print(f"{'case':32} {'us/token':>9} {'spread':>8} {'% of step':>10}")
    for name, run in cases.items():
        med, spread = timed(run, n, a.repeats)
        print(f"{name:32} {med:9.2f} {spread:8.2f} {med / (STEP_MS * 1e3) * 100:9.3f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

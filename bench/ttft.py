"""Time to first token: meshd (one node, and 2 stages on loopback) against llama-server.

    python bench/ttft.py                      # 15 requests each, 5 rounds of 8 streams
    python bench/ttft.py --repeats 30 --rounds 10 --cores 0,1
    python bench/ttft.py --skip meshd2,repeated --keep-logs

One run, one machine, one GGUF (the default model unless ``--model``), every server
pinned to the same cores (``--cores``, default every core this process may use: the
bench pins itself while it starts each one, and their children inherit it). Greedy,
``ignore_eos``, ``--tokens`` (8) tokens a request, ~30-token chat prompts:

* ``distinct``: every request its own prompt (its text starts with its own number), so
  no prefix cache helps either side;
* ``repeated``: the same prompt every time (both sides may reuse their cached prefix).

Subjects: ``llama-server`` (llama.cpp's own C++ server, built by bench/_rpc.py; when it
is not built the row says so: ``--build`` builds it, several minutes), ``direct``
(llama-cpp-python in a worker process, no HTTP: the floor), ``meshd1`` and ``meshd2``.
The requests of one stream interleave the subjects (one each in turn, the order rotating),
after ``--warmup`` requests each; 8 concurrent new requests (``--streams``) run
``--rounds`` times per subject, interleaved too. Each figure is a median (min-max); the
ratios are meshd / llama-server (else / direct) over the same run.

Then meshd's time to first token broken down from the API node's own timestamps
(``meshd_first_token_phase_seconds``, see ``meshd/api/firsttoken.py``), the client's
share (client TTFT minus the node's), and stage 0's prefill batching at 8 streams
(``meshd_stage0_prefills``: engine calls that ran prompts, and the most in one call).
A benchmark: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _common import (
    DEFAULT_MODEL,
    FLASH_ATTN,
    N_CTX,
    Node,
    Stream,
    WorkerProc,
    add_worker_args,
    http_client,
    log,
    med,
    metric_delta,
    place,
    run_concurrent,
    run_measure,
    scrape,
    start_node,
    stream_chat,
    table,
    wait_live,
)

TOPICS = [
    "what makes a good cup of tea?", "why is the sky blue?", "how do bees find flowers?",
    "what is a prime number?", "why do cats purr?", "how does a bicycle stay upright?",
    "what is the tallest tree?", "why does bread rise?", "how far away is the moon?",
]  # fmt: skip
PHASES = ["api", "admit", "stage0", "prefill", "deliver"]
_NUMBERS = itertools.count(1000)


def messages(n: int) -> list[dict[str, str]]:
    """Prompt number ``n``: ~30 tokens with the default model's template, its own from
    the first token of the system line on."""
    return [
        {"role": "system", "content": f"Note {n}: answer briefly."},
        {"role": "user", "content": f"Question {n}: {TOPICS[n % len(TOPICS)]}"},
    ]


def prompt_numbers(variant: str, k: int) -> list[int]:
    """``k`` prompt numbers: new ones (``distinct``), or the same one (``repeated``)."""
    return [next(_NUMBERS) for _ in range(k)] if variant == "distinct" else [7] * k


# -- the floor: llama-cpp-python in a worker process ---------------------------------------


def worker_main(args: argparse.Namespace) -> int:
    """Hold the model; answer ``{"n": [...]}`` lines with each prompt's time to its
    first token (run one after another, each from a reset context)."""
    import llama_cpp

    from meshd.models.chat import CHATML_TEMPLATE, chat_template_at, render_chat

    path, threads = args.worker_model, args.worker_threads
    llm = llama_cpp.Llama(path, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                          flash_attn=FLASH_ATTN, verbose=False)  # fmt: skip
    template = chat_template_at(path) or CHATML_TEMPLATE
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        t_sent = time.perf_counter()
        out = []
        for n in cmd["n"]:
            text = render_chat(template, messages(n), add_generation_prompt=True)
            toks = llm.tokenize(text.encode(), add_bos=True, special=True)
            llm.reset()
            tok = next(iter(llm.generate(toks, temp=0.0)))
            llm.detokenize([tok])
            t = time.perf_counter()
            out.append({"t_sent": t_sent, "t_first": t, "t_last": t, "t_end": t, "tokens": 1})
        print(json.dumps(out), flush=True)
    return 0


class Direct(WorkerProc):
    def __init__(self, tmp: Path, model_path: str, threads: int) -> None:
        args = ["--worker-model", model_path, "--worker-threads", str(threads)]
        super().__init__(__file__, tmp, args, quit_line='{"quit": true}')

    def ttfts(self, numbers: list[int]) -> list[float]:
        answer = self.ask(json.dumps({"n": numbers}))
        return [Stream(**d, events=1).ttft for d in answer]


# -- subjects ------------------------------------------------------------------------------


@dataclass
class Subject:
    key: str
    label: str
    #: TTFT of one request with prompt number n; of k concurrent ones.
    one: Callable[[int], float]
    many: Callable[[list[int]], list[float]]
    #: meshd: its node and its model's name (the metrics' label).
    node: Node | None = None
    model: str = ""
    ttft: dict[str, list[float]] = field(default_factory=dict)


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """This process (and what it starts meanwhile) on ``cores`` only."""
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def http_subject(key: str, label: str, base: str, payload: Callable[[int], dict]) -> Subject:
    client = http_client()

    def one(n: int) -> float:
        return stream_chat(client, base, payload(n)).ttft

    def many(ns: list[int]) -> list[float]:
        return [s.ttft for s in run_concurrent(base, [payload(n) for n in ns], len(ns)).streams]

    return Subject(key, label, one, many)


def start_llama_server(tmp: Path, model_path: str, args: argparse.Namespace) -> Subject:
    """llama.cpp's own server as bench/compare.py runs it (``--streams`` slots, plain
    attention, no prompt cache across slots), on the default-settings prompt cache."""
    import _rpc
    from _common import Proc, whole_model_env
    from compare import free_port, wait_http

    bin_dir = _rpc.built() or (_rpc.ensure_built(log=log) if args.build else None)
    if bin_dir is None:
        raise RuntimeError("llama-server is not built (python bench/_rpc.py, or --build)")
    port = free_port()
    cmd = [
        str(bin_dir / _rpc.LLAMA_SERVER), "--model", model_path,
        "--threads", str(args.threads), "--threads-batch", str(args.threads),
        "--ctx-size", str(N_CTX * args.streams), "--parallel", str(args.streams),
        "--cont-batching", "--flash-attn", "on" if FLASH_ATTN else "off", "--no-webui",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    proc = Proc(cmd, tmp / "llama-server.log", env=whole_model_env())
    base = f"http://127.0.0.1:{port}"
    wait_http(base, "/health", proc, 120.0)

    def payload(n: int) -> dict:
        return {"model": "bench", "messages": messages(n), "stream": True, "temperature": 0,
                "max_tokens": args.tokens, "ignore_eos": True}  # fmt: skip

    return http_subject("llama-server", "llama-server (llama.cpp's C++ server)", base, payload)


def start_direct(tmp: Path, model_path: str, args: argparse.Namespace) -> Subject:
    d = Direct(tmp, model_path, args.threads)
    # k requests at once queue as in a one-sequence server: each timed from the start.
    return Subject("direct", "direct (llama-cpp-python, no HTTP)",
                   lambda n: d.ttfts([n])[0], d.ttfts)  # fmt: skip


def start_meshd(tmp: Path, model_path: str, args: argparse.Namespace) -> list[Subject]:
    """Nodes a and b on loopback; the model on [a] and, under a symlink, on [a, b]."""
    stages = [n for n in (1, 2) if f"meshd{n}" not in args.skip]
    names = ["a", "b"][: max(stages)]
    models = tmp / "models"
    models.mkdir()
    # The same threads as llama-server and the direct worker get. Left to its tuner, a
    # node counts the other servers' turns on these cores as load and drops its runner
    # to 1 thread (the first quiet run: 304 ms of prefill against 243 ms pinned).
    os.environ.setdefault("MESHD_THREADS", str(args.threads))
    cluster = f"ttft-{os.getpid()}"
    nodes: list[Node] = []
    for name in names:
        nodes.append(start_node(tmp, name, cluster, peers=nodes[:1],
                                extra=["--models", str(models)]))  # fmt: skip
    client = http_client()
    wait_live(client, nodes[0], set(names), 30.0)
    out = []
    for k in stages:
        model = args.model
        if k > 1:
            link = models / f"{Path(model_path).stem}-{k}stages.gguf"
            link.symlink_to(model_path)
            model = str(link)
        place(client, nodes[0], model, names[:k])

        def payload(n: int, model: str = model) -> dict:
            return {"model": model, "messages": messages(n), "stream": True,
                    "temperature": 0, "max_tokens": args.tokens, "ignore_eos": True}  # fmt: skip

        s = http_subject(f"meshd{k}", f"meshd, {k} stage{'s' if k > 1 else ''}",
                         nodes[0].api, payload)  # fmt: skip
        s.node = nodes[0]
        out.append(s)
    return out


# -- measuring -----------------------------------------------------------------------------


def warm_up(subjects: list[Subject], variant: str, args: argparse.Namespace) -> None:
    """``--warmup`` lone requests each, not counted."""
    for s in subjects:
        for _ in range(args.warmup):
            s.one(prompt_numbers(variant, 1)[0])


def measure_one(subjects: list[Subject], variant: str, args: argparse.Namespace) -> None:
    """``--repeats`` lone requests each, the subjects in turn."""
    for rep in range(args.repeats):
        for i in range(len(subjects)):
            s = subjects[(i + rep) % len(subjects)]
            s.ttft.setdefault(f"{variant}-1", []).append(s.one(prompt_numbers(variant, 1)[0]))


def measure_many(subjects: list[Subject], args: argparse.Namespace) -> None:
    """``--rounds`` of ``--streams`` new distinct requests at once, the subjects in turn."""
    for rnd in range(args.rounds):
        for i in range(len(subjects)):
            s = subjects[(i + rnd) % len(subjects)]
            s.ttft.setdefault(f"distinct-{args.streams}", []).extend(
                s.many(prompt_numbers("distinct", args.streams))
            )


def cell(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{med(xs) * 1000:.1f} ({min(xs) * 1000:.1f}-{max(xs) * 1000:.1f})"


def ratio(a: list[float], b: list[float]) -> str:
    return f"{med(a) / med(b):.2f}" if a and b else "-"


def breakdown(s: Subject, before: dict, after: dict) -> list[str]:
    """Mean ms of each phase of ``s``'s first tokens between two scrapes."""
    out = []
    total = 0.0
    for phase in PHASES:
        got = metric_delta(before, after, "meshd_first_token_phase_seconds",
                           model=s.model, phase=phase)  # fmt: skip
        ms = got[0] / got[1] * 1000 if got else float("nan")
        total += ms if phase != "stage0" else 0.0
        out.append(f"{ms:.2f}")
    return [*out, f"{total:.2f}"]


def measure(args: argparse.Namespace, tmp: Path) -> int:
    from meshd.engines.threads import default_threads
    from meshd.models.resolve import resolve_model

    args.threads = args.threads or default_threads()
    args.skip = set(filter(None, args.skip.split(",")))
    model_path = str(resolve_model(args.model).path)
    cores = {int(c) for c in args.cores.split(",")} if args.cores else os.sched_getaffinity(0)
    print(f"model {model_path}, {args.threads} threads, servers on cores {sorted(cores)}, "
          f"{args.tokens} tokens a request")  # fmt: skip
    subjects: list[Subject] = []
    missing: list[str] = []
    starters = [("llama-server", start_llama_server), ("direct", start_direct)]
    with pinned(cores):
        for key, start in starters:
            if key in args.skip:
                continue
            try:
                subjects.append(start(tmp, model_path, args))
            except Exception as e:
                missing.append(f"{key}: {e}")
        if not {"meshd1", "meshd2"} <= args.skip:
            subjects += start_meshd(tmp, model_path, args)
    if not subjects:
        print("nothing to measure: " + "; ".join(missing))
        return 0
    meshd = [s for s in subjects if s.node is not None]
    client = http_client()

    def metrics() -> dict:
        return scrape(client, meshd[0].node) if meshd and meshd[0].node else {}

    scrapes: dict[str, tuple[dict, dict]] = {}
    for variant in ("distinct", "repeated"):
        if variant in args.skip:
            continue
        log(f"{variant} prompts, 1 stream: {args.warmup} + {args.repeats} requests each")
        warm_up(subjects, variant, args)
        before = metrics()
        measure_one(subjects, variant, args)
        scrapes[f"{variant}-1"] = (before, metrics())
    log(f"{args.streams} concurrent new requests, {args.rounds} rounds each")
    before = metrics()
    measure_many(subjects, args)
    after = metrics()
    scrapes[f"distinct-{args.streams}"] = (before, after)
    name_models(meshd, after)
    report(subjects, missing, scrapes, args)
    return 0


def name_models(meshd: list[Subject], metrics: dict) -> None:
    """Each meshd subject's model label in the metrics (the 2-stage one is the
    symlink's name)."""
    labels = {dict(k[1]).get("model", "") for k in metrics
              if k[0].startswith("meshd_first_token_phase_seconds")}  # fmt: skip
    for s in meshd:
        split = s.key != "meshd1"
        s.model = next((m for m in labels if ("stages" in m) == split), "")


def report(
    subjects: list[Subject], missing: list[str], scrapes: dict[str, tuple[dict, dict]],
    args: argparse.Namespace,
) -> None:  # fmt: skip
    keys = [k for k in ("distinct-1", "repeated-1", f"distinct-{args.streams}")
            if any(k in s.ttft for s in subjects)]  # fmt: skip
    by = {s.key: s for s in subjects}
    base = by.get("llama-server") or by.get("direct")
    print()
    print("Time to first token at the client, ms: median (min-max)")
    rows = [[s.label, *(cell(s.ttft.get(k, [])) for k in keys)] for s in subjects]
    print(table(rows, ["subject", *keys]))
    for line in missing:
        print(f"  not measured: {line}")
    if base is not None:
        print(f"\nRatios of medians, / {base.key} (goal <= 1.5 against llama-server)")
        rows = [[s.label, *(ratio(s.ttft.get(k, []), base.ttft.get(k, [])) for k in keys)]
                for s in subjects if s is not base]  # fmt: skip
        print(table(rows, ["subject", *keys]))
    meshd = [s for s in subjects if s.node is not None]
    if not meshd:
        return
    print("\nmeshd's first token at its API node, mean ms by phase (meshd/api/firsttoken.py;")
    print("stage0 is part of admit), and the client's share (client mean - node's)")
    rows = []
    for key, (before, after) in scrapes.items():
        for s in meshd:
            if key not in s.ttft:
                continue
            phases = breakdown(s, before, after)
            client = sum(s.ttft[key]) / len(s.ttft[key]) * 1000
            rows.append([s.key, key, *phases, f"{client - float(phases[-1]):.2f}"])
    print(table(rows, ["subject", "run", *PHASES, "node", "client"]))
    before, after = scrapes.get(f"distinct-{args.streams}", ({}, {}))
    for inst in sorted({dict(k[1]).get("instance", "") for k in after
                        if k[0] == "meshd_stage0_prefills"}):  # fmt: skip

        def fig(f: str, inst: str = inst) -> float:
            k = ("meshd_stage0_prefills", frozenset({("instance", inst), ("figure", f)}))
            return after.get(k, 0.0) - (before.get(k, 0.0) if f != "widest" else 0.0)

        print(f"instance {inst[:12]}: {args.rounds} rounds of {args.streams} new requests ran "
              f"their prompts in {fig('calls'):.0f} engine calls at stage 0 "
              f"({fig('steps'):.0f} prompt steps; the most in one call so far "
              f"{fig('widest'):.0f})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--repeats", type=int, default=15, help="lone requests per subject")
    p.add_argument("--warmup", type=int, default=3, help="lone requests first, not counted")
    p.add_argument("--rounds", type=int, default=5, help="rounds of --streams requests")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8, help="tokens a request")
    p.add_argument("--threads", type=int, default=0, help="default: meshd's default_threads()")
    p.add_argument("--cores", default="", help="cores the servers run on (default: all)")
    p.add_argument("--skip", default="", help="comma-separated: llama-server, direct, "
                   "meshd1, meshd2, distinct, repeated")  # fmt: skip
    p.add_argument("--build", action="store_true", help="build llama-server if it is not")
    p.add_argument("--keep-logs", action="store_true")
    add_worker_args(p)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    return run_measure("meshd-ttft-", args.keep_logs, lambda tmp: measure(args, tmp))


if __name__ == "__main__":
    sys.exit(main())

"""meshd side by side with the peers users would pick instead: one run, one machine, one GGUF.

    python bench/compare.py                   # 3 repeats, 64 tokens, 1 and 8 streams
    python bench/compare.py --quick           # 2 repeats, 32 tokens
    python bench/compare.py --repeats 5 --skip mlx --json out.json

Subjects, all on the same GGUF (the default model unless ``--model``), greedy, a fixed
prompt set, the same threads and ``GOMP_SPINCOUNT`` (a whole model's: the meshd runner's
own where it holds one, ``_common.whole_model_env``):

* ``direct``: llama-cpp-python in process (``Llama.generate``, whole model): the floor;
* ``llama-server``: llama.cpp's own C++ server (built by bench/_rpc.py from the
  installed llama-cpp-python's source), ``-np 8`` slots with continuous batching: the
  anchor a user runs on one machine;
* ``llama_cpp.server``: llama-cpp-python's own OpenAI server;
* ``llama.cpp RPC``: the same server, the last half of the layers (and the head) on one
  ``ggml-rpc-server`` over loopback (built by bench/_rpc.py from the installed
  llama-cpp-python's own source into ``~/.cache/meshd-bench``);
* ``mlx_lm.server`` on the same weights (bench/_mlx.py makes the MLX folder offline);
* meshd with 1, 2 and 3 stages (``meshd up`` nodes a, b, c on loopback).

For each: decode tok/s and time to first token at 1 and 8 concurrent streams, and
meshd's per-hop time from its own ``/metrics``; then meshd 1 stage / llama-server, and
two meshd 1-stage figures: turn 2 of a ~1,500-token chat with the prefix cache / turn 1,
and decode with ``speculate`` / without on a code-edit prompt. In each repeat and phase (1 stream,
then 8 streams) direct runs first and last, the others in between in an order that
rotates; every figure is divided by the mean of those two direct figures, and the
table shows the median of those ratios over the repeats and their spread. The raw
numbers go to a JSON file. A benchmark: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from _common import (
    DEFAULT_MODEL,
    FLASH_ATTN,
    N_CTX,
    Node,
    OthersMeter,
    Proc,
    Stream,
    WorkerProc,
    add_worker_args,
    chat_payload,
    counted,
    cpu_busy,
    cpu_model,
    http_client,
    llama_server_missing,
    log,
    med,
    metric_delta,
    place,
    run_concurrent,
    run_measure,
    scrape,
    start_llama_server,
    start_node,
    stream_chat,
    table,
    version,
    wait_live,
    whole_model_env,
)

#: The fixed prompt set: a distinct system line first, so no server's prefix cache
#: reuses one prompt's KV for another (they share ``<|im_start|>system\n`` only).
#: Stream i of a concurrent run sends prompt i; single streams send the last one.
PROMPTS = [
    (
        "You are a storyteller for children.",
        "Write a long story about a robot who learns to paint.",
    ),
    ("Answer as a patient history teacher.", "Explain how the printing press changed Europe."),
    (
        "Cooking assistant, concise and practical.",
        "Describe how to bake bread at home, step by step.",
    ),
    (
        "Travel guide with a taste for detail.",
        "Describe a week-long trip through the Alps by train.",
    ),
    ("Science writer for a general audience.", "Explain why the sky is blue and sunsets are red."),
    ("Gardening expert speaking to beginners.", "How do I grow tomatoes on a small balcony?"),
    ("Friendly software mentor.", "Explain what a hash table is and why lookups are fast."),
    ("Music critic with strong opinions.", "Write a review of an imaginary jazz album."),
    ("Sports commentator, lively tone.", "Narrate the final minute of a close football match."),
]


def messages(i: int) -> list[dict[str, str]]:
    system, user = PROMPTS[i % len(PROMPTS)]
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


SINGLE = len(PROMPTS) - 1  # the prompt of the single-stream runs
#: Goals against llama.cpp's own server: (key, what, "<=" or ">=", target).
CPP_GOALS = [
    ("aggk", "aggregate tok/s, {k} streams", ">=", 1.0),
    ("ttft1", "TTFT, 1 stream", "<=", 1.5),
    ("ttftk", "TTFT, {k} streams (median stream)", "<=", 1.5),
    ("decode1", "decode tok/s, 1 stream", "", 0.0),
]
#: Goal of the prefix cache: turn 2's time to first token / turn 1's.
PREFIX_GOAL = 0.2
#: Seeds of the long texts of the prefix figure: every conversation its own.
_SEEDS = itertools.count(1_000)
T = TypeVar("T")

# -- direct llama-cpp-python (a worker process) -----------------------------------------


def worker_main(args: argparse.Namespace) -> int:
    """Hold the model in this process; answer ``{"prompts": [...], "tokens": n}`` lines
    with one timing per prompt, the prompts run back to back (one ``Llama`` serves one
    sequence at a time), every one counted from the moment the line arrived."""
    import llama_cpp

    from meshd.models.chat import CHATML_TEMPLATE, chat_template_at, render_chat

    path, threads = args.worker_model, args.worker_threads
    llm = llama_cpp.Llama(
        path,
        n_ctx=N_CTX,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=FLASH_ATTN,
        verbose=False,
    )
    template = chat_template_at(path) or CHATML_TEMPLATE
    prompts = [
        llm.tokenize(
            render_chat(template, messages(i), add_generation_prompt=True).encode(),
            add_bos=True,
            special=True,
        )
        for i in range(len(PROMPTS))
    ]
    info = {
        "ready": True,
        "n_prompt": [len(p) for p in prompts],
        "n_layers": int(llama_cpp.llama_model_n_layer(llm.model)),
        "eos": [int(llama_cpp.llama_vocab_eos(llama_cpp.llama_model_get_vocab(llm.model)))],
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        t_sent = time.perf_counter()
        out = []
        for i in cmd["prompts"]:
            ts: list[float] = []
            # Every request prefills its whole prompt, as everywhere else: without the
            # reset, Llama.generate would keep the KV of the longest common prefix with
            # the previous prompt (the whole prompt when a single stream runs again).
            llm.reset()
            # Llama.generate yields tokens until told to stop: EOS does not end it.
            for tok in llm.generate(prompts[i], temp=0.0):
                llm.detokenize([tok])  # text per token, as a stream needs
                ts.append(time.perf_counter())
                if len(ts) >= cmd["tokens"]:
                    break
            out.append(
                {
                    "t_sent": t_sent,
                    "t_first": ts[0],
                    "t_last": ts[-1],
                    "t_end": ts[-1],
                    "tokens": len(ts),
                }
            )
        print(json.dumps(out), flush=True)
    return 0


class Direct(WorkerProc):
    """The worker process: llama-cpp-python in process, same GGUF, same settings."""

    def __init__(self, tmp: Path, model_path: str, threads: int) -> None:
        args = ["--worker-model", model_path, "--worker-threads", str(threads)]
        super().__init__(__file__, tmp, args, quit_line='{"quit": true}')

    def run(self, prompts: list[int], tokens: int) -> list[Stream]:
        answer = self.ask(json.dumps({"prompts": prompts, "tokens": tokens}))
        return [Stream(**d, events=d["tokens"]) for d in answer]


# -- subjects ------------------------------------------------------------------------------


@dataclass
class Subject:
    """One row: how to run 1 stream and k streams, and what it measured."""

    key: str
    label: str
    one: Callable[[int], Stream] | None = None
    many: Callable[[int, int], list[Stream]] | None = None
    #: The meshd model name (for its metrics), when the subject is meshd.
    meshd_model: str | None = None
    n_stages: int = 0
    #: Tokens per request when the subject cannot afford the common count.
    tokens: int | None = None
    #: Measured in the first repeat only.
    once: bool = False
    error: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    close: Callable[[], None] | None = None

    def fail(self, why: str) -> None:
        self.error = why.splitlines()[0][:200]
        log(f"{self.key}: {self.error}")
        if self.close is not None:
            with contextlib.suppress(Exception):
                self.close()
        self.one = self.many = None


def http_subject(key: str, label: str, base: str, payload: Callable[[int, int], dict]) -> Subject:
    client = http_client()

    def one(tokens: int) -> Stream:
        return stream_chat(client, base, payload(SINGLE, tokens))

    def many(k: int, tokens: int) -> list[Stream]:
        return run_concurrent(base, [payload(i, tokens) for i in range(k)], k).streams

    return Subject(key, label, one, many)


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.proc.returncode}: {proc.tail(5)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on port {port}")
        time.sleep(0.05)


def wait_http(base: str, path: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with http_client(5.0) as c:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if c.get(base + path).status_code == 200:
                    return
            if proc.proc.poll() is not None:
                raise RuntimeError(f"exited {proc.proc.returncode}: {proc.tail(5)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base}{path} did not answer")
            time.sleep(0.2)


def start_rpc(tmp: Path, model_path: str, threads: int, n_layers: int) -> tuple[Subject, str]:
    """ggml-rpc-server + llama_cpp.server whose process loaded the RPC backend."""
    import _rpc

    from meshd.engines.threads import runner_env

    bin_dir = _rpc.ensure_built(log=log)
    port = free_port()
    # Both ends hold a pipeline stage: the spin count meshd gives those.
    rpc = Proc(
        _rpc.server_command(bin_dir, port, threads), tmp / "rpc-server.log", env=runner_env()
    )
    wait_port(port, rpc, 30.0)
    # Layers [n/2, n) and the output head on the RPC server, the rest (and the token
    # embedding, always local in llama.cpp) in the server process: llama.cpp offloads
    # the last n_gpu_layers "layers", the head counting as layer n.
    offload = n_layers - n_layers // 2 + 1
    launcher = [sys.executable, str(Path(_rpc.__file__).resolve()), "serve", f"127.0.0.1:{port}"]
    proc, url = start_llama_server(
        tmp,
        model_path,
        threads,
        launcher=launcher,
        extra=["--n_gpu_layers", str(offload)],
        name="rpc-llama-server",
        env=runner_env(),
    )
    s = http_subject(
        "rpc",
        "llama.cpp RPC 2-way (llama_cpp.server + 1 ggml-rpc-server)",
        url,
        lambda i, n: chat_payload("bench", n, meshd=False, messages=messages(i)),
    )

    def close() -> None:
        proc.stop()
        rpc.stop()

    s.close = close
    split = f"layers 0-{n_layers // 2 - 1} local, {n_layers // 2}-{n_layers - 1} + head on RPC"
    return s, split


def start_cpp_server(tmp: Path, model_path: str, threads: int, slots: int) -> Subject:
    """llama.cpp's C++ ``llama-server`` from bench/_rpc.py's build (the same llama.cpp
    source as the installed llama-cpp-python): ``slots`` slots with continuous batching,
    ``N_CTX`` tokens of context each (``-c`` is the total), ``FLASH_ATTN``, no web UI,
    no prompt cache (``-cram 0`` and ``cache_prompt: false``: every request prefills
    its whole prompt, as everywhere else)."""
    import _rpc

    bin_dir = _rpc.ensure_built(log=log)
    port = free_port()
    args = [
        str(bin_dir / _rpc.LLAMA_SERVER), "--model", model_path,
        "--threads", str(threads), "--threads-batch", str(threads),
        "--ctx-size", str(N_CTX * slots), "--parallel", str(slots), "--cont-batching",
        "--flash-attn", "on" if FLASH_ATTN else "off", "--cache-ram", "0", "--no-webui",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    proc = Proc(args, tmp / "llama-server-cpp.log", env=whole_model_env())
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base, "/health", proc, 120.0)  # 503 while it loads
    except Exception:
        proc.stop()
        raise

    def payload(i: int, n: int) -> dict:
        return {
            "model": "bench", "messages": messages(i), "stream": True, "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "cache_prompt": False,
            "stream_options": {"include_usage": True},
        }  # fmt: skip

    label = f"llama-server (llama.cpp's C++ server, -np {slots})"
    s = http_subject("llama-server", label, base, payload)
    s.close = proc.stop
    return s


def start_mlx(tmp: Path, model_path: str, eos: list[int], tokens: int) -> Subject:
    import _mlx

    folder = _mlx.mlx_folder(Path(model_path), log=log)
    port = free_port()
    # --prompt-cache-size 0: every request prefills its whole prompt, as everywhere else.
    args = [
        sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--host",
        "127.0.0.1", "--port", str(port), "--prompt-cache-size", "0",
    ]  # fmt: skip
    proc = Proc(args, tmp / "mlx-server.log")
    base = f"http://127.0.0.1:{port}"
    wait_http(base, "/v1/models", proc, 120.0)
    bias = {str(t): -100 for t in eos}  # no EOS: every request runs to max_tokens

    def payload(i: int, n: int) -> dict:
        return {
            "model": "default_model", "messages": messages(i), "stream": True,
            "max_tokens": n, "temperature": 0, "logit_bias": bias,
            "stream_options": {"include_usage": True},
        }  # fmt: skip

    s = http_subject("mlx", "mlx_lm.server (MLX on this machine's CPU)", base, payload)
    s.close = proc.stop
    s.tokens, s.once = tokens, True
    return s


# -- figures -------------------------------------------------------------------------------

#: (key, header, lower is better)
COLUMNS = [
    ("decode1", "decode tok/s, 1 stream", False),
    ("ttft1", "TTFT, 1 stream", True),
    ("decodek", "decode tok/s per stream, {k} streams", False),
    ("aggk", "aggregate tok/s, {k} streams", False),
    ("ttftk", "TTFT, {k} streams (median stream)", True),
]


def figures(one: Stream | None, many: list[Stream] | None) -> dict[str, float]:
    f: dict[str, float] = {}
    if one is not None:
        f["decode1"], f["ttft1"] = one.decode_tok_s, one.ttft
    if many:
        t0 = min(s.t_sent for s in many)
        f["decodek"] = med([s.decode_tok_s for s in many])
        f["aggk"] = sum(s.tokens for s in many) / (max(s.t_end for s in many) - t0)
        f["ttftk"] = med([s.t_first - t0 for s in many])
    return f


def stream_json(s: Stream) -> dict[str, float]:
    t0 = s.t_sent
    return {"ttft_s": s.t_first - t0, "first_to_last_s": s.t_last - s.t_first,
            "end_s": s.t_end - t0, "tokens": s.tokens, "events": s.events}  # fmt: skip


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def ratios(subj: Subject, base: Subject, key: str) -> list[float]:
    """subj / base for each repeat where both measured ``key``."""
    out = []
    for r in subj.runs:
        b = next((x for x in base.runs if x["repeat"] == r["repeat"]), None)
        x, y = r["fig"].get(key), b["fig"].get(key) if b else None
        if x is not None and y and x == x and y == y:
            out.append(x / y)
    return out


def cell(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{med(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def hop_metrics(before: dict, after: dict, model: str) -> dict[str, float]:
    """Per-token means (ms) from meshd's histograms between two scrapes of the API node:
    the inter-token time there and the pipeline overhead per hop."""
    out = {}
    for key, name in (
        ("hop_ms", "meshd_pipeline_overhead_seconds"),
        ("itl_ms", "meshd_inter_token_seconds"),
    ):
        sc = metric_delta(before, after, name, model=model)
        if sc:
            out[key] = 1000 * sc[0] / sc[1]
    return out


def least_shared(
    run: Callable[[], T], key: str, args: argparse.Namespace, once: bool = False
) -> tuple[T, float, int]:
    """``run()`` taken again up to ``--retries`` times (not when ``once``) while other
    processes used more than ``--max-others`` of the CPUs during it: the result that
    shared the machine least, that share, and how many attempts it took."""
    best: tuple[T, float] | None = None
    attempts = 0
    for attempt in range(1 + (0 if once else max(0, args.retries))):
        attempts = attempt + 1
        meter = OthersMeter()
        result = run()
        share = meter.share()
        if best is None or share < best[1]:
            best = (result, share)
        if not share > args.max_others:  # NaN (no /proc) counts as quiet
            break
        log(f"{key}: other processes used {100 * share:.0f}% of the CPUs; again")
    assert best is not None
    return best[0], best[1], attempts


def measure_once(
    s: Subject,
    phase: str,
    tok: int,
    k: int,
    client: httpx.Client,
    nodes: list[Node],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One measurement of ``s`` (``phase`` "one" or "many"), through :func:`least_shared`
    (a subject measured once, MLX: a minute a burst, is not taken again)."""
    assert s.one is not None and s.many is not None
    one, many = s.one, s.many

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        if phase == "one":
            before = scrape(client, nodes[0]) if s.meshd_model else {}
            out["result"] = one(tok)
            if s.meshd_model:
                out["hop"] = hop_metrics(before, scrape(client, nodes[0]), s.meshd_model)
        else:
            out["result"] = many(k, tok)
        return out

    best, share, attempts = least_shared(run, s.key, args, s.once)
    return {**best, "others": share, "attempts": attempts}


# -- meshd 1 stage: prefix cache and speculative decoding ------------------------------


def prefix_once(client: httpx.Client, api: str, model: str, words: int) -> dict[str, float]:
    """Turn 2 of a long chat against turn 1, bench/prefix.py's way: turn 1 is a new
    text of ``words`` words (~1,500 tokens at 1450) and a question, so nothing of it is
    cached; its answer (16 tokens at most, greedy) and one more question make turn 2.
    No request says ``cache_prompt``: greedy ones reuse a kept prefix by default."""
    import prefix

    seed = next(_SEEDS)
    first = [{"role": "user", "content": f"{prefix.long_text(seed, words)}\n\nWhich word "
              "comes first?"}]  # fmt: skip
    t1, u1, answer = prefix.ttft(client, api, first, model=model)
    history = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And which word comes last?"},
    ]
    t2, u2, _ = prefix.ttft(client, api, history, model=model)

    def cached(u: dict) -> int:
        return int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    return {
        "turn1_s": t1, "turn2_s": t2, "ratio": t2 / t1,
        "turn1_prompt": u1.get("prompt_tokens", 0), "turn1_cached": cached(u1),
        "turn2_prompt": u2.get("prompt_tokens", 0), "turn2_cached": cached(u2),
    }  # fmt: skip


def spec_once(
    client: httpx.Client, node: Node, model: str, tokens: int, spec_first: bool
) -> dict[str, float]:
    """Decode tok/s of bench/speculate.py's code-edit prompt with ``speculate`` true and
    false (greedy, ``ignore_eos``, ``tokens`` tokens), in the order given, and the share
    of drafted tokens the pipeline accepted (from ``/metrics``)."""
    import speculate

    msgs = [{"role": "user", "content": speculate.SETS["code edit"]}]
    rate: dict[bool, float] = {}
    before = scrape(client, node)
    for spec in (spec_first, not spec_first):
        p = chat_payload(model, tokens, meshd=True, messages=msgs)
        p["speculate"] = spec
        rate[spec] = stream_chat(client, node.api, p).decode_tok_s
    after = scrape(client, node)
    drafted = counted(before, after, "meshd_draft_tokens_total")
    accepted = counted(before, after, "meshd_draft_tokens_accepted_total")
    return {
        "plain_tok_s": rate[False], "spec_tok_s": rate[True],
        "ratio": rate[True] / rate[False], "drafted": drafted, "accepted": accepted,
    }  # fmt: skip


def meshd1_extras(
    subjects: list[Subject],
    client: httpx.Client,
    nodes: list[Node],
    rep: int,
    skip: set[str],
    notes: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The prefix-cache and speculative figures of meshd 1 stage for one repeat (each
    through :func:`least_shared`), as ``{"prefix": {...}, "speculate": {...}}``."""
    s = next((x for x in subjects if x.key == "meshd1" and x.one is not None), None)
    if s is None or s.meshd_model is None or not nodes:
        return {}
    model, node = s.meshd_model, nodes[0]
    out: dict[str, Any] = {}
    runs: dict[str, Callable[[], dict[str, float]]] = {
        "prefix": lambda: prefix_once(client, node.api, model, args.prefix_words),
        "speculate": lambda: spec_once(client, node, model, args.spec_tokens, rep % 2 == 0),
    }
    for key, run in runs.items():
        if key in skip:
            continue
        try:
            fig, share, attempts = least_shared(run, f"meshd1 {key}", args)
        except Exception as e:
            notes.append(f"meshd1 {key}, repeat {rep + 1}: {type(e).__name__}: {e}")
            log(notes[-1])
            continue
        out[key] = {**fig, "others_cpu_share": share, "attempts": attempts}
    return out


# -- the run -------------------------------------------------------------------------------


def measure(args: argparse.Namespace, tmp: Path) -> int:
    from meshd.engines.threads import default_threads
    from meshd.models.resolve import resolve_model

    t_run = time.perf_counter()
    model = args.model
    model_path = str(resolve_model(model).path)
    if args.threads:
        # Every subject reads it: meshd's runners through the nodes' environment.
        os.environ["MESHD_THREADS"] = str(args.threads)
    threads = args.threads or default_threads()
    k, n_tok = args.streams, args.tokens
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    load_start = os.getloadavg()
    busy = cpu_busy(1.0)
    subjects: list[Subject] = []
    notes: list[str] = []
    nodes: list[Node] = []
    client = http_client()

    def add_missing(key: str, label: str, why: str) -> None:
        s = Subject(key, label)
        s.error = why
        subjects.append(s)
        log(f"{key}: {why}")

    try:
        # ---- direct -------------------------------------------------------------------
        log(f"loading {model_path} in a llama-cpp-python worker ({threads} threads)")
        direct = Direct(tmp, model_path, threads)
        n_layers = int(direct.info["n_layers"])
        subjects.append(
            Subject(
                "direct",
                "llama-cpp-python in process (the floor)",
                lambda n: direct.run([SINGLE], n)[0],
                lambda kk, n: direct.run(list(range(kk)), n),
                close=direct.close,
            )
        )

        # ---- llama.cpp's C++ llama-server ----------------------------------------------
        label = "llama-server (llama.cpp's C++ server)"
        if "llama-server" in skip:
            add_missing("llama-server", label, "skipped (--skip)")
        else:
            log(f"starting llama.cpp's llama-server (-np {k})")
            try:
                subjects.append(start_cpp_server(tmp, model_path, threads, k))
            except Exception as e:
                add_missing("llama-server", label, f"{type(e).__name__}: {e}")

        # ---- llama_cpp.server -------------------------------------------------------
        why = llama_server_missing()
        label = "llama_cpp.server (llama-cpp-python's OpenAI server)"
        if "server" in skip:
            add_missing("server", label, "skipped (--skip)")
        elif why:
            add_missing("server", label, why)
        else:
            log("starting llama_cpp.server")
            try:
                proc, url = start_llama_server(tmp, model_path, threads)
                s = http_subject(
                    "server",
                    label,
                    url,
                    lambda i, n: chat_payload("bench", n, meshd=False, messages=messages(i)),
                )
                s.close = proc.stop
                subjects.append(s)
            except Exception as e:
                add_missing("server", label, f"did not start: {e}")

        # ---- llama.cpp RPC ----------------------------------------------------------------
        label = "llama.cpp RPC 2-way split"
        if "rpc" in skip:
            add_missing("rpc", label, "skipped (--skip)")
        elif why:
            add_missing("rpc", label, f"runs in llama_cpp.server: {why}")
        else:
            log("starting ggml-rpc-server and llama_cpp.server with the RPC backend")
            try:
                s, split = start_rpc(tmp, model_path, threads, n_layers)
                subjects.append(s)
                notes.append(f"llama.cpp RPC: {split}, both sides {threads} threads")
            except Exception as e:
                add_missing("rpc", label, f"{type(e).__name__}: {e}")

        # ---- mlx_lm.server ----------------------------------------------------------
        label = "mlx_lm.server"
        import _mlx

        mlx_why = _mlx.mlx_missing()
        if "mlx" in skip:
            add_missing("mlx", label, "skipped (--skip)")
        elif mlx_why:
            add_missing("mlx", label, f"MLX is not installed: {mlx_why}")
        else:
            log("starting mlx_lm.server")
            try:
                s = start_mlx(tmp, model_path, direct.info["eos"], min(n_tok, args.mlx_tokens))
                subjects.append(s)
            except Exception as e:
                add_missing("mlx", label, f"{type(e).__name__}: {e}")

        # ---- meshd ----------------------------------------------------------------------
        stage_counts = [n for n in (1, 2, 3) if f"meshd{n}" not in skip]
        if stage_counts:
            log(f"starting meshd nodes on loopback; placing {stage_counts} stage(s)")
            cluster = f"compare-{os.getpid()}-{time.monotonic_ns()}"
            names = ["a", "b", "c"][: max(stage_counts)]
            # The model's other names live in a folder every node takes as a model root
            # (a node loads only from its own roots, whatever a plan names).
            models_dir = tmp / "models"
            models_dir.mkdir(exist_ok=True)
            for name in names:
                nodes.append(start_node(tmp, name, cluster, peers=nodes[:1],
                                        extra=["--models", str(models_dir)]))  # fmt: skip
            a = nodes[0]
            wait_live(client, a, set(names), 30.0)
            # One GGUF, three names (the alias and two symlinks), so the three instances
            # live side by side and the repeats interleave them.
            for n in stage_counts:
                name = model
                if n > 1:
                    link = models_dir / f"{Path(model_path).stem}-{n}stages.gguf"
                    link.symlink_to(model_path)
                    name = str(link)
                label = f"meshd, {n} stage{'s' if n > 1 else ''} (loopback nodes)"
                try:
                    place(client, a, name, names[:n])
                except Exception as e:
                    add_missing(f"meshd{n}", label, f"placement failed: {e}")
                    continue

                def payload(i: int, tok: int, name: str = name) -> dict:
                    return chat_payload(name, tok, meshd=True, messages=messages(i))

                s = http_subject(f"meshd{n}", label, a.api, payload)
                s.meshd_model, s.n_stages = name, n
                subjects.append(s)

        ranks = ["direct", "llama-server", "server", "rpc", "mlx", "meshd1", "meshd2", "meshd3"]
        order = {key: i for i, key in enumerate(ranks)}
        subjects.sort(key=lambda s: order.get(s.key, 99))
        live = [s for s in subjects if s.one is not None]

        # ---- warm-up: one short request and one short burst each ----------------------
        log("warm-up")
        for s in live:
            try:
                assert s.one is not None and s.many is not None
                s.one(min(8, s.tokens or n_tok))
                if not s.once:  # a burst of MLX on a CPU costs a minute
                    s.many(k, min(8, s.tokens or n_tok))
            except Exception as e:
                s.fail(f"warm-up failed: {type(e).__name__}: {e}")

        # ---- repeats: direct brackets the others (whose order rotates), per phase -----
        t_rep = 0.0
        base = subjects[0]
        for rep in range(args.repeats):
            used = time.perf_counter() - t_run
            if rep and used + t_rep > args.budget:
                notes.append(
                    f"only {rep} of {args.repeats} repeats: --budget is {args.budget:.0f} s"
                )
                break
            t0 = time.perf_counter()
            others = [x for x in subjects[1:] if x.one is not None and not x.once]
            if others:
                others = others[rep % len(others) :] + others[: rep % len(others)]
            # Subjects measured once (MLX: minutes) go after the bracket closes.
            tail = [x for x in subjects[1:] if x.one is not None and x.once and not rep]
            seq = [base, *others, base, *tail]
            log(f"repeat {rep + 1}/{args.repeats}: {', '.join(x.key for x in seq)}")
            got: dict[str, dict[str, Any]] = {x.key: {"one": [], "many": []} for x in subjects}
            for phase in ("one", "many"):
                for s in seq:
                    if s.one is None or s.many is None:
                        continue
                    tok = s.tokens or n_tok
                    try:
                        best = measure_once(s, phase, tok, k, client, nodes, args)
                    except Exception as e:
                        s.fail(f"repeat {rep + 1}: {type(e).__name__}: {e}")
                        continue
                    got[s.key][phase].append(best["result"])
                    got[s.key].setdefault("others", []).append(best["others"])
                    got[s.key].setdefault("attempts", []).append(best["attempts"])
                    if "hop" in best:
                        got[s.key]["hop"] = best["hop"]
            extra = meshd1_extras(subjects, client, nodes, rep, skip, notes, args)
            for s in subjects:
                g = got[s.key]
                if not g["one"] and not g["many"]:
                    continue
                # direct: the mean of its two brackets; the others: their one measurement
                figs = [figures(o, None) for o in g["one"]] + [figures(None, m) for m in g["many"]]
                keys = {key for f in figs for key in f}
                fig = {key: mean([f[key] for f in figs if key in f]) for key in keys}
                s.runs.append(
                    {
                        "repeat": rep,
                        "tokens": s.tokens or n_tok,
                        "fig": fig,
                        "meshd_1_stream": g.get("hop", {}),
                        "others_cpu_share": g.get("others", []),
                        "attempts": g.get("attempts", []),
                        "one": [stream_json(x) for x in g["one"]],
                        "many": [[stream_json(x) for x in m] for m in g["many"]],
                        **(extra if s.key == "meshd1" else {}),
                    }
                )
            t_rep = time.perf_counter() - t0
    except (Exception, KeyboardInterrupt, SystemExit) as e:
        notes.append(f"stopped early: {type(e).__name__}: {e}".splitlines()[0])
        log(notes[-1])
    finally:
        for s in subjects:
            if s.close is not None:
                with contextlib.suppress(Exception):
                    s.close()
        for n in nodes:
            n.proc.stop()
        client.close()

    report(args, subjects, notes, model, model_path, threads, load_start, busy, t_run)
    return 0


def report(
    args: argparse.Namespace,
    subjects: list[Subject],
    notes: list[str],
    model: str,
    model_path: str,
    threads: int,
    load_start: tuple[float, float, float],
    busy: float,
    t_run: float,
) -> None:
    k = args.streams
    by = {s.key: s for s in subjects}
    direct = by.get("direct")
    load_end = os.getloadavg()
    print()
    print("meshd vs the alternatives: every figure / direct llama-cpp-python, same repeat")
    print("=" * 78)
    print(
        f"machine   {cpu_model()}, {os.cpu_count()} CPUs ({threads} threads per engine), "
        f"{platform.system()} {platform.release()}"
    )
    print(
        f"load      load average {load_start[0]:.2f} at start ({100 * busy:.0f}% busy), "
        f"{load_end[0]:.2f} at end"
    )
    print(
        f"software  python {platform.python_version()}, meshd {version('meshd')}, "
        f"llama-cpp-python {version('llama_cpp_python')}, mlx-lm {version('mlx-lm')}"
    )
    size = Path(model_path).stat().st_size / 2**20
    print(f"model     {model} = {model_path} ({size:.0f} MiB)")
    done = len(direct.runs) if direct else 0
    print(
        f"settings  {args.tokens} tokens per request, greedy, no EOS, {len(PROMPTS)} fixed "
        f"prompts, 1 and {k} concurrent streams; {done} of {args.repeats} repeats"
    )
    if busy > 0.5 or load_start[0] > threads / 2:
        print(
            f"WARNING   the machine was busy before the run ({100 * busy:.0f}%): absolute "
            f"rates are low, ratios noisier"
        )
    print()
    print(
        "Ratio to direct, median over repeats (min-max); TTFT: lower is better. hop ms: "
        "meshd's pipeline overhead per hop (its /metrics, 1 stream). others: share of the "
        "CPUs other processes used during the subject's measurements (median)."
    )
    header = ["subject"] + [h.format(k=k) for _, h, _ in COLUMNS] + ["hop ms", "others"]

    def others(s: Subject) -> str:
        xs = [x for r in s.runs for x in r.get("others_cpu_share", []) if x == x]
        return f"{100 * med(xs):.0f}%" if xs else "-"

    rows = []
    for s in subjects:
        if direct is None or not s.runs:
            rows.append([s.label] + ["n/a"] * len(COLUMNS) + ["-", "-"])
            rows.append([f"  n/a: {s.error or 'not measured'}"] + [""] * (len(COLUMNS) + 2))
            continue
        if s is direct:
            row = [s.label]
            for key, _, _ in COLUMNS:
                v = med([r["fig"][key] for r in s.runs if key in r["fig"]])
                unit = "s" if key.startswith("ttft") else "tok/s"
                row.append(f"1 = {v:.3f} s" if unit == "s" else f"1 = {v:.1f} tok/s")
            rows.append([*row, "-", others(s)])
            continue
        row = [s.label] + [cell(ratios(s, direct, key)) for key, _, _ in COLUMNS]
        hops = [r["meshd_1_stream"]["hop_ms"] for r in s.runs if "hop_ms" in r["meshd_1_stream"]]
        rows.append([*row, cell(hops) if s.meshd_model else "-", others(s)])
        extra = []
        if s.tokens and s.tokens != args.tokens:
            extra.append(f"{s.tokens} tokens per request")
        if s.once:
            extra.append("first repeat only")
        if s.error:
            extra.append(f"stopped: {s.error}")
        if extra:
            rows.append([f"  note: {'; '.join(extra)}"] + [""] * (len(COLUMNS) + 2))
    print(table(rows, header))
    cpp = anchor_report(by, k)

    # ---- goals -------------------------------------------------------------------------
    def paired(a: str, b: str, key: str) -> list[float]:
        if a in by and b in by:
            return ratios(by[a], by[b], key)
        return []

    goals = [
        ("meshd 1 stage / direct, decode 1 stream", paired("meshd1", "direct", "decode1"), 0.97),
        ("meshd 2 stages / llama.cpp RPC 2-way, decode 1 stream",
         paired("meshd2", "rpc", "decode1"), 1.5),
        (f"meshd 2 stages / llama.cpp RPC 2-way, aggregate {k} streams",
         paired("meshd2", "rpc", "aggk"), 1.5),
        (f"meshd 1 stage / llama_cpp.server, aggregate {k} streams",
         paired("meshd1", "server", "aggk"), 2.0),
    ]  # fmt: skip
    print()
    print("Goals (paired ratios within each repeat: median, min-max)")
    grows = []
    for name, xs, goal in goals:
        if not xs:
            grows.append([name, "-", "-", f">= {goal}", "not measured"])
            continue
        v = med(xs)
        grows.append(
            [
                name,
                f"{v:.2f}",
                f"{min(xs):.2f}-{max(xs):.2f}",
                f">= {goal}",
                "met" if v >= goal else "NOT met",
            ]
        )
    grows.append(
        ["added latency of one hop, p50 (bench/hop.py)", "-", "-", "<= 100 us", "see bench/hop.py"]
    )
    print(table(grows, ["goal", "value", "spread", "goal", "result"]))

    # ---- meshd: where the time per token goes ------------------------------------------
    mrows = []
    for s in subjects:
        if not s.meshd_model or not s.runs:
            continue
        ms = [r["meshd_1_stream"] for r in s.runs]

        def m(key: str, ms: list[dict] = ms) -> str:
            xs = [x[key] for x in ms if key in x]
            return f"{med(xs):.2f}" if xs else "-"

        client_ms = med([1000 / r["fig"]["decode1"] for r in s.runs if r["fig"].get("decode1")])
        itl = [
            x["itl_ms"] - s.n_stages * x["hop_ms"] for x in ms if "itl_ms" in x and "hop_ms" in x
        ]
        engine = f"{med(itl):.2f}" if itl else "-"
        mrows.append(
            [s.label, f"{client_ms:.2f}", m("itl_ms"), engine, m("hop_ms"), str(s.n_stages)]
        )
    if mrows:
        d1 = [1000 / r["fig"]["decode1"] for r in direct.runs] if direct and direct.runs else []
        print()
        print(
            "meshd, 1 stream, ms per token (median over repeats): at the client; at the API "
            "node (meshd_inter_token_seconds); the stages' engine time (API node - hops x "
            "per hop); per hop (meshd_pipeline_overhead_seconds: inter-token time minus the "
            "stages' engine time, / hops; n stages make n hops, the last one back to stage 0)"
        )
        if d1:
            mrows.insert(0, ["direct llama-cpp-python", f"{med(d1):.2f}", "-", "-", "-", "-"])
        print(
            table(
                mrows,
                ["subject", "client", "API node", "engines (summed)", "per hop", "hops"],
            )
        )

    again = sum(a - 1 for s in subjects for r in s.runs for a in r.get("attempts", []))
    if again:
        notes.append(
            f"{again} measurement(s) taken again because other processes used more than "
            f"{100 * args.max_others:.0f}% of the CPUs (--max-others, --retries)"
        )
    for n in notes:
        print(f"note: {n}")

    # ---- JSON ----------------------------------------------------------------------------
    out = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": threads,
                    "load_start": load_start, "busy_start": busy, "load_end": load_end},
        "software": {d: version(d) for d in ("meshd", "llama_cpp_python", "mlx", "mlx-lm")},
        "model": {"name": model, "path": model_path},
        "settings": {"tokens": args.tokens, "streams": k, "repeats": args.repeats,
                     "prompts": PROMPTS, "single_stream_prompt": SINGLE},
        "subjects": {s.key: {"label": s.label, "error": s.error, "runs": s.runs}
                     for s in subjects},
        "ratios_to_direct": {
            s.key: {key: ratios(s, direct, key) for key, _, _ in COLUMNS}
            for s in subjects if direct is not None
        },
        "goals": [{"goal": name, "ratios": xs, "target": goal} for name, xs, goal in goals],
        "meshd1_vs_llama_server": cpp,
        "notes": notes,
    }  # fmt: skip
    path = Path(args.json) if args.json else default_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"\nraw numbers: {path}")
    print(f"total run time {time.perf_counter() - t_run:.0f} s")


def verdict(v: float, op: str, goal: float) -> str:
    if not op:
        return "-"
    return "met" if (v >= goal if op == ">=" else v <= goal) else "NOT met"


def anchor_report(by: dict[str, Subject], k: int) -> dict[str, Any]:
    """Print meshd 1 stage against llama.cpp's ``llama-server`` (paired ratios within
    each repeat), the prefix-cache and the speculative figures; return them for the
    JSON."""
    out: dict[str, Any] = {}
    m1, cpp = by.get("meshd1"), by.get("llama-server")
    rows = []
    for key, what, op, goal in CPP_GOALS:
        xs = ratios(m1, cpp, key) if m1 and cpp else []
        out[key] = xs
        target = f"{op} {goal}x" if op else "-"
        if not xs:
            why = (cpp.error if cpp else None) or (m1.error if m1 else None) or "not measured"
            rows.append([what.format(k=k), "-", "-", target, f"n/a: {why}"[:60]])
            continue
        v = med(xs)
        rows.append([what.format(k=k), f"{v:.2f}", f"{min(xs):.2f}-{max(xs):.2f}", target,
                     verdict(v, op, goal)])  # fmt: skip
    runs = m1.runs if m1 else []
    pre = [r["prefix"] for r in runs if "prefix" in r]
    if pre:
        xs = [x["ratio"] for x in pre]
        v = med(xs)
        n2, c2, t1, t2 = (
            med([x[key] for x in pre])
            for key in ("turn2_prompt", "turn2_cached", "turn1_s", "turn2_s")
        )
        what = (
            f"prefix cache: TTFT turn 2 / turn 1 ({n2:.0f}-token turn 2, {c2:.0f} cached; "
            f"turn 1 {t1:.3f} s, turn 2 {t2:.3f} s)"
        )
        rows.append([what, f"{v:.2f}", f"{min(xs):.2f}-{max(xs):.2f}", f"<= {PREFIX_GOAL}x",
                     verdict(v, "<=", PREFIX_GOAL)])  # fmt: skip
    out["prefix"] = pre
    spec = [r["speculate"] for r in runs if "speculate" in r]
    if spec:
        xs = [x["ratio"] for x in spec]
        drafted = sum(x["drafted"] for x in spec)
        acc = f"{sum(x['accepted'] for x in spec) / drafted:.0%}" if drafted else "none"
        plain, fast = med([x["plain_tok_s"] for x in spec]), med([x["spec_tok_s"] for x in spec])
        what = (
            f"speculate / plain, decode tok/s, code edit ({plain:.1f} -> {fast:.1f} tok/s, "
            f"{acc} of drafts accepted)"
        )
        rows.append([what, f"{med(xs):.2f}", f"{min(xs):.2f}-{max(xs):.2f}", "-", "-"])
    out["speculate"] = spec
    print()
    print(
        "meshd 1 stage / llama-server (llama.cpp's C++ server, continuous batching): paired "
        "ratios within each repeat, median (min-max); then meshd 1 stage alone"
    )
    print(table(rows, ["meshd 1 stage", "ratio", "min-max", "goal", "result"]))
    return out


def default_json() -> Path:
    from _rpc import CACHE

    return CACHE / "results" / time.strftime("compare-%Y%m%d-%H%M%S.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="repeats (default 3)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model (default %(default)s)")
    p.add_argument(
        "--threads",
        type=int,
        help="threads of every llama.cpp engine, meshd's runners included through "
        "MESHD_THREADS (default: meshd's default_threads(), the usable cores)",
    )
    p.add_argument(
        "--mlx-tokens",
        type=int,
        default=16,
        help="tokens per request for mlx_lm.server, measured in the first repeat only: MLX "
        "on a CPU is ~20x slower than llama.cpp (default %(default)s)",
    )
    p.add_argument(
        "--skip",
        default="",
        help="comma-separated subjects to leave out: llama-server, server, rpc, mlx, meshd1, "
        "meshd2, meshd3; and meshd 1 stage's figures: prefix, speculate",
    )
    p.add_argument(
        "--prefix-words",
        type=int,
        default=1450,
        help="words of the long text of the prefix-cache figure (default %(default)s: "
        "~1,500 tokens)",
    )
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=96,
        help="tokens per request of the speculative figure (default %(default)s)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=480.0,
        help="seconds: start no repeat that would end past it (default %(default)s)",
    )
    p.add_argument(
        "--max-others",
        type=float,
        default=0.25,
        help="share of the CPUs other processes may use during a measurement before it is "
        "taken again (default %(default)s)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="how many times a measurement is taken again while the machine is shared "
        "(default %(default)s; the least shared attempt is kept)",
    )
    p.add_argument(
        "--json",
        help="where the raw numbers go (default: a new file under ~/.cache/meshd-bench/results/)",
    )
    p.add_argument("--quick", action="store_true", help="2 repeats, 32 tokens")
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary dir")
    add_worker_args(p)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.quick:
        args.repeats, args.tokens = min(args.repeats, 2), min(args.tokens, 32)
    args.repeats = max(1, args.repeats)
    return run_measure("meshd-compare-", args.keep_logs, lambda tmp: measure(args, tmp))


if __name__ == "__main__":
    raise SystemExit(main())

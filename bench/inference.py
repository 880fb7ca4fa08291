"""Inference speed of meshd against llama-cpp-python, measured in one run on one machine.

    python bench/inference.py                 # 3 repeats, 128 tokens, 8 streams
    python bench/inference.py --quick         # 2 repeats, 64 tokens, 1 start-up repeat
    python bench/inference.py --repeats 5 --tokens 256

Everything runs on loopback with OS-chosen ports, on the same GGUF (the default model
unless ``--model``), and every figure is a ratio against a baseline measured in the
same run, interleaved with it repeat by repeat (paired ratios: median, min-max):

1. decode tok/s of one meshd stage / direct llama-cpp-python in process (goal >= 0.97)
2. two meshd stages on loopback (two nodes) / one stage (goal >= 0.90)
3. aggregate tok/s of 8 concurrent streams / 1 stream on one node (goal >= 2), and
   meshd / llama-cpp-python's own OpenAI server at 8 streams (goal >= 2)
4. seconds from starting ``meshd up`` (it places the default model itself) to the
   first streamed token of a chat request (goal <= 5 s)

It is a benchmark, not a test: it prints figures and exits 0 whatever they are. See
bench/README.md for what each figure measures and how to read it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEFAULT_MODEL,
    FLASH_ATTN,
    N_CTX,
    PROMPT,
    READY,
    CpuMeter,
    Figure,
    HttpError,
    MetricSeries,
    Node,
    Proc,
    Series,
    WorkerProc,
    add_worker_args,
    chat_payload,
    cpu_busy,
    cpu_model,
    http_client,
    llama_server_missing,
    log,
    med,
    meshd_command,
    metric_delta,
    paired,
    place,
    run_concurrent,
    run_measure,
    runner_pids,
    scrape,
    spread,
    start_llama_server,
    start_node,
    stream_chat,
    table,
    version,
    wait_live,
    whole_model_env,
)

from meshd.domain.chat import ChatTurn
from meshd.domain.job import Job
from meshd.domain.sampling import Sampling

# -- direct llama-cpp-python (a worker process) ---------------------------------------


def worker_main(args: argparse.Namespace) -> int:
    """Load the GGUF in this process and answer timing commands on stdin, one JSON a line.

    Commands: ``generate`` (llama-cpp-python's own Llama.generate loop, greedy, n_threads
    = --threads), ``generate1`` (the same with one thread fewer), ``stageK`` (meshd's
    LlamaStage.forward + greedy Sampler + detokenizer on K sequences batched: the runner's
    engine path with no IPC), ``quit``. Each answers {"tok_s": decode rate from the first
    token to the last, "agg": tokens / time from before the prefill}."""
    import numpy as np

    from meshd.domain.sampling import Sampling
    from meshd.engines.detok import IncrementalDetokenizer
    from meshd.engines.llama_stage import LlamaStage
    from meshd.engines.sampling import Sampler
    from meshd.engines.stage import StageInput
    from meshd.models.chat import CHATML_TEMPLATE, chat_template_at, render_chat

    path, n, threads = args.worker_model, args.tokens, args.worker_threads
    text = render_chat(
        chat_template_at(path) or CHATML_TEMPLATE,
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
    )
    import llama_cpp

    def llama(t: int) -> Any:
        return llama_cpp.Llama(
            path, n_ctx=N_CTX, n_threads=t, n_threads_batch=t, flash_attn=FLASH_ATTN, verbose=False
        )

    llms = {"generate": llama(threads)}
    if threads > 1:
        llms["generate1"] = llama(threads - 1)
    stage = LlamaStage(path, first=True, last=True, n_ctx=N_CTX, n_seq_max=8, n_threads=threads)
    prompt = stage.tokenize(text, add_special=True, parse_special=True)

    def run_generate(llm: Any) -> dict[str, float]:
        llm.reset()  # no prefix reuse: a full prefill, as meshd does
        t0 = time.perf_counter()
        ts: list[float] = []
        for tok in llm.generate(prompt, temp=0.0, reset=True):
            llm.detokenize([tok])  # text per token, as a stream needs
            ts.append(time.perf_counter())
            if len(ts) >= n:
                break
        return {"tok_s": (len(ts) - 1) / (ts[-1] - ts[0]), "agg": len(ts) / (ts[-1] - t0)}

    def run_stage(k: int) -> dict[str, float]:
        """``k`` sequences of the same prompt, every step one batched forward."""
        samplers = [Sampler(Sampling(temperature=0.0)) for _ in range(k)]
        detoks = [IncrementalDetokenizer(stage.token_to_piece) for _ in range(k)]
        t0 = time.perf_counter()
        first = np.asarray(prompt, np.int32)
        outs = stage.forward([StageInput(seq=i, pos=0, tokens=first) for i in range(k)])
        pos = len(prompt)
        ts: list[float] = []
        while True:
            toks = [sm.sample(lg) for sm, lg in zip(samplers, outs, strict=True)]
            for d, tok in zip(detoks, toks, strict=True):
                d.push(tok)
            ts.append(time.perf_counter())
            if len(ts) >= n:
                break
            outs = stage.forward(
                [
                    StageInput(seq=i, pos=pos, tokens=np.array([tok], np.int32))
                    for i, tok in enumerate(toks)
                ]
            )
            pos += 1
        for i in range(k):
            stage.free(i)
        return {"tok_s": k * (len(ts) - 1) / (ts[-1] - ts[0]), "agg": k * len(ts) / (ts[-1] - t0)}

    ready = {"ready": True, "n_prompt": len(prompt), "n_layers": stage.n_layers}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        stage_k = int(cmd[5:] or 1) if cmd.startswith("stage") else 0
        out = run_stage(stage_k) if stage_k else run_generate(llms[cmd])
        print(json.dumps(out), flush=True)
    return 0


class Direct(WorkerProc):
    """The worker process: llama-cpp-python in process, same GGUF, same settings."""

    def __init__(self, tmp: Path, model_path: str, tokens: int, threads: int) -> None:
        args = ["--worker-model", model_path, "--worker-threads", str(threads)]
        super().__init__(__file__, tmp, [*args, "--tokens", str(tokens)], quit_line="quit")

    def run(self, cmd: str) -> dict[str, float]:
        """``generate``, ``generate1``, ``stage`` or ``stageK`` (K sequences batched)."""
        return self.ask(cmd)


class BareRunner:
    """meshd's runner process (one stage: the whole model) driven over ZeroMQ by this
    script, as a node would drive it: no node, no asyncio, no HTTP, no SSE."""

    def __init__(self, tmp: Path, model_path: str, n_layers: int) -> None:
        import zmq

        from meshd.engines.protocol import RunnerConfig, runner_command
        from meshd.models.hashing import file_sha256

        # The runner checks that its file is the model placed (by sha256).
        cfg = RunnerConfig(
            instance="bench", generation=1, stage=0, n_stages=1, model_path=model_path,
            sha256=file_sha256(Path(model_path)), start=0, end=n_layers, n_layers=n_layers,
            cache_dir=str(tmp / "bare-cache"), bind_host="127.0.0.1",
        )  # fmt: skip
        args, config_line = runner_command(cfg)
        # stdin stays open: the runner exits when it closes.
        self.proc = Proc(
            args, tmp / "bare-runner.log", env=whole_model_env(), stdin=subprocess.PIPE
        )
        self.proc.write_stdin(config_line)
        _, m = self.proc.wait_line(re.compile(r'"event": ?"listening", ?"port": ?(\d+)'), 60.0)
        self.port = int(m[1])
        self.proc.wait_line(re.compile(r'"event": ?"ready"'), 120.0)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.reply_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(f"tcp://127.0.0.1:{self.port}")

    def run(self, tokens: int) -> float:
        """Decode tok/s of one greedy ignore_eos request, timed where chunks arrive."""
        import secrets

        import zmq

        from meshd.transport import wire

        req = secrets.token_hex(8)
        g = wire.Generate(
            req=req, instance="bench", generation=1,
            route=[wire.Addr(node="runner", addresses=["127.0.0.1"], port=self.port)],
            reply_to=wire.Addr(node="bench", addresses=["127.0.0.1"], port=self.reply_port),
            job=Job(
                messages=[ChatTurn("user", PROMPT)],
                sampling=Sampling(temperature=0.0, max_tokens=tokens, ignore_eos=True),
            ),
        )  # fmt: skip
        self.dealer.send(wire.encode(g))
        ts: list[float] = []
        while True:
            if not self.router.poll(60_000, zmq.POLLIN):
                raise TimeoutError("the bare runner sent nothing for 60 s")
            frames = self.router.recv_multipart()
            now = time.perf_counter()
            mine = [c for c in wire.chunks_in(wire.decode_output(frames[-1])) if c.req == req]
            for msg in mine:
                if msg.error is not None:
                    raise RuntimeError(f"runner: {msg.error.code}: {msg.error.message}")
                # A chunk may carry several tokens (see meshd.engines.outbox).
                ts.extend([now] * len(msg.tokens))
            if any(msg.finish_reason is not None for msg in mine):
                break
        return (len(ts) - 1) / (ts[-1] - ts[0])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.dealer.close(0)
            self.router.close(0)
            self.ctx.term()
        self.proc.stop()


# -- time to first token from `meshd up` -----------------------------------------------


@dataclass
class Startup:
    total: float
    ready: float | None = None
    marks: dict[str, float] = field(default_factory=dict)


def startup_once(tmp: Path, data_dir: Path, model: str, tag: str) -> Startup:
    """Start ``meshd up`` with its defaults (it places the default model itself), then
    stream a chat request as soon as the API answers; seconds to the first token."""
    args = [
        *meshd_command(), "up", "--no-discovery", "--api-port", "0", "--mesh-port", "0",
        "--mesh-host", "127.0.0.1", "--data-dir", str(data_dir),
    ]  # fmt: skip
    if model != DEFAULT_MODEL:
        args += ["--model", model]
    proc = Proc(args, tmp / f"startup-{tag}.log")
    t0 = proc.t_start
    try:
        t_ready, m = proc.wait_line(READY, 60.0)
        base = m["api"]
        payload = chat_payload(model, 8, meshd=True)
        deadline = time.monotonic() + 120.0
        t_asked = time.perf_counter()
        with http_client() as c:
            while True:
                try:
                    s = stream_chat(c, base, payload)
                    break
                except (httpx.TransportError, HttpError) as e:
                    # Not answering yet, or 503 while loading past the API's own wait.
                    if isinstance(e, HttpError) and e.status not in (502, 503):
                        raise
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        marks = {}
        for label, rx in (
            ("node up", r"node .* up: api"),
            ("placed", r"placed "),
            ("runner started", r"starting runner"),
            ("runner ready", r"runner .* ready on port"),
        ):
            t = proc.first_line(rx)
            if t is not None:
                marks[label] = t - t0
        marks["ready line"] = t_ready - t0
        marks["chat request sent"] = t_asked - t0
        marks["first token"] = s.t_first - t0
        return Startup(total=s.t_first - t0, ready=t_ready - t0, marks=marks)
    finally:
        proc.stop()


def measure(args: argparse.Namespace, tmp: Path) -> int:
    from meshd.engines.threads import default_threads
    from meshd.models.resolve import resolve_model

    t_run = time.perf_counter()
    model = args.model
    model_path = str(resolve_model(model).path)
    threads = default_threads()
    k = args.streams
    load_start = os.getloadavg()
    busy = cpu_busy(1.0)

    labels = {
        "direct": "llama-cpp-python in process, Llama.generate (baseline of 1.)",
        "direct_t1": f"the same with n_threads={threads - 1}",
        "stage": "meshd's LlamaStage + Sampler in process, 1 sequence (no IPC)",
        "bare": "meshd's runner process alone, driven over ZeroMQ (no node, no HTTP)",
        "m1": "meshd, 1 stage, 1 stream",
        "m2": "meshd, 2 stages on loopback, 1 stream",
        "srv1": "llama_cpp.server, 1 stream",
        "agg1": "meshd, 1 stage, 1 stream (baseline of 3a.)",
        "agg8": f"meshd, 1 stage, {k} streams",
        "srv8": f"llama_cpp.server, {k} streams (baseline of 3b.)",
        "stage1_agg": "meshd's LlamaStage in process, 1 sequence",
        "stage8_agg": f"meshd's LlamaStage in process, {k} sequences batched",
        "ttft": "meshd up -> first token, fresh data dir",
        "ttft_warm": "meshd up -> first token, data dir of an earlier start",
    }
    if threads < 2:
        del labels["direct_t1"]
    S = {key: Series(v, "s" if key.startswith("ttft") else "tok/s") for key, v in labels.items()}
    metrics = {0: MetricSeries(), 1: MetricSeries(), 2: MetricSeries()}
    cpu = CpuMeter()
    startups: list[Startup] = []
    notes: list[str] = []
    n_prompt: object = "?"
    interrupted = False

    direct: Direct | None = None
    bare: BareRunner | None = None
    server: Proc | None = None
    server_url = ""
    nodes: list[Node] = []
    cluster = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    client = http_client()
    me = [os.getpid()]
    try:
        # ---- setup: direct worker, two nodes, two instances, llama_cpp.server -------
        log(f"loading {model_path} in a llama-cpp-python worker ({threads} threads)")
        direct = Direct(tmp, model_path, args.tokens, threads)
        n_prompt = direct.info.get("n_prompt", "?")
        log("starting a bare meshd runner")
        try:
            bare = BareRunner(tmp, model_path, int(direct.info["n_layers"]))
        except Exception as e:
            S["bare"].error = f"{type(e).__name__}: {e}".splitlines()[0]
        log("starting meshd nodes a and b on loopback")
        a = start_node(tmp, "a", cluster)
        b = start_node(tmp, "b", cluster, peers=[a])
        nodes = [a, b]
        wait_live(client, a, {"a", "b"}, 30.0)
        # The same GGUF under two names: the alias on one stage, the file's path on two
        # stages, so both instances live side by side and interleave repeat by repeat.
        log("placing 1 stage on a, 2 stages on a+b")
        i1 = place(client, a, model, ["a"])
        i2 = place(client, a, model_path, ["a", "b"])
        r1 = runner_pids(a.proc.proc.pid, i1)
        r2 = {**runner_pids(a.proc.proc.pid, i2), **runner_pids(b.proc.proc.pid, i2)}
        why = llama_server_missing()
        if why is None:
            log("starting llama_cpp.server")
            try:
                server, server_url = start_llama_server(tmp, model_path, threads)
            except Exception as e:
                why = f"llama_cpp.server did not start: {e}".splitlines()[0]
        if why:
            S["srv1"].error = S["srv8"].error = why + "; row skipped"

        p1 = chat_payload(model, args.tokens, meshd=True)
        p2 = chat_payload(model_path, args.tokens, meshd=True)
        ps = chat_payload("bench", args.tokens, meshd=False)

        log("warm-up")
        direct.run("generate")
        direct.run(f"stage{k}")
        if bare is not None:
            bare.run(args.tokens)
        stream_chat(client, a.api, p1)
        stream_chat(client, a.api, p2)
        run_concurrent(a.api, p1, k)
        p1_collected = {key: v for key, v in p1.items() if key not in ("stream", "stream_options")}
        if server is not None:
            stream_chat(client, server_url, ps)

        # ---- repeats, interleaved ----------------------------------------------------
        t_rep = 0.0
        for i in range(args.repeats):
            used = time.perf_counter() - t_run
            if i and used + t_rep > args.budget * 0.75:
                notes.append(
                    f"only {i} of {args.repeats} repeats: the machine is slow now and "
                    f"--budget is {args.budget:.0f} s"
                )
                break
            log(f"repeat {i + 1}/{args.repeats}")
            t_rep = time.perf_counter()
            with cpu.run("direct", {"llama-cpp-python process": [direct.p.pid]}) as box:
                S["direct"].xs.append(direct.run("generate")["tok_s"])
                box[0] = args.tokens
            if "direct_t1" in S:
                S["direct_t1"].xs.append(direct.run("generate1")["tok_s"])
            out = direct.run("stage1")
            S["stage"].xs.append(out["tok_s"])
            S["stage1_agg"].xs.append(out["agg"])
            S["stage8_agg"].xs.append(direct.run(f"stage{k}")["agg"])

            if bare is not None:
                try:
                    bare_groups = {"runner": [bare.proc.proc.pid], "client (zmq)": me}
                    with cpu.run("bare", bare_groups) as box:
                        S["bare"].xs.append(bare.run(args.tokens))
                        box[0] = args.tokens
                except Exception as e:
                    S["bare"].error = f"{type(e).__name__}: {e}".splitlines()[0]
                    bare.close()
                    bare = None

            before = scrape(client, a)
            groups = {"runner": list(r1.values()), "node a (API)": [a.proc.proc.pid], "client": me}
            with cpu.run("m1", groups) as box:
                s = stream_chat(client, a.api, p1)
                box[0] = s.tokens
            after = scrape(client, a)
            S["m1"].xs.append(s.decode_tok_s)
            S["agg1"].xs.append(s.tokens / (s.t_end - s.t_sent))
            record(metrics[1], before, after, model, 1)

            # The same request not streamed: the node still gets every chunk, but
            # writes no SSE event and the client parses nothing until the end.
            with cpu.run("m1c", groups) as box:
                r = client.post(a.api + "/v1/chat/completions", json=p1_collected)
                r.raise_for_status()
                box[0] = int(r.json()["usage"]["completion_tokens"])
            before, after = after, scrape(client, a)
            record(metrics[0], before, after, model, 1)

            groups = {
                "runner stage 0 (node a)": [r2.get(0, 0)],
                "runner stage 1 (node b)": [r2.get(1, 0)],
                "node a (API)": [a.proc.proc.pid],
                "node b": [b.proc.proc.pid],
                "client": me,
            }
            with cpu.run("m2", groups) as box:
                s = stream_chat(client, a.api, p2)
                box[0] = s.tokens
            before, after = after, scrape(client, a)
            S["m2"].xs.append(s.decode_tok_s)
            record(metrics[2], before, after, model_path, 2)

            groups = {"runner": list(r1.values()), "node a (API)": [a.proc.proc.pid], "client": me}
            with cpu.run("m8", groups) as box:
                c8 = run_concurrent(a.api, p1, k)
                box[0] = c8.tokens
            S["agg8"].xs.append(c8.agg_tok_s)

            if server is not None:
                try:
                    S["srv1"].xs.append(stream_chat(client, server_url, ps).decode_tok_s)
                    S["srv8"].xs.append(run_concurrent(server_url, ps, k).agg_tok_s)
                except Exception as e:
                    S["srv1"].error = S["srv8"].error = f"failed: {e}".splitlines()[0]
                    server.stop()
                    server = None
            t_rep = time.perf_counter() - t_rep
    except (Exception, KeyboardInterrupt, SystemExit) as e:
        notes.append(f"throughput phase stopped early: {type(e).__name__}: {e}".splitlines()[0])
        log(notes[-1])
        interrupted = not isinstance(e, Exception)
    finally:
        if direct is not None:
            direct.close()
        if bare is not None:
            bare.close()
        if server is not None:
            server.stop()
        for n in nodes:
            n.proc.stop()

    # ---- start-up to first token (nothing else of ours running) -----------------------
    warm_dir = tmp / "startup-warm"
    for i in range(0 if interrupted else args.startup_repeats):
        if i and time.perf_counter() - t_run > args.budget:
            notes.append(f"only {i} start-up(s) of each kind: --budget is {args.budget:.0f} s")
            break
        for key, data_dir in (("ttft", tmp / f"startup-fresh-{i}"), ("ttft_warm", warm_dir)):
            log(f"start-up {'fresh' if key == 'ttft' else 'reused'} data dir {i + 1}")
            try:
                if key == "ttft_warm" and not warm_dir.exists():
                    startup_once(tmp, warm_dir, model, "warm-prime")  # fills its cache
                st = startup_once(tmp, data_dir, model, f"{key}-{i}")
                S[key].xs.append(st.total)
                if key == "ttft":
                    startups.append(st)
            except (Exception, KeyboardInterrupt, SystemExit) as e:
                S[key].error = f"{type(e).__name__}: {e}".splitlines()[0]
                log(S[key].error)
                if not isinstance(e, Exception):
                    interrupted = True
                    break
        if interrupted:
            break
    client.close()

    # ---- report ---------------------------------------------------------------------
    load_end = os.getloadavg()
    done = max((len(S[key].xs) for key in ("direct", "m1", "agg8")), default=0)
    print()
    print("meshd inference benchmark")
    print("=========================")
    print(
        f"machine   {cpu_model()}, {os.cpu_count()} CPUs ({threads} usable by this process), "
        f"{platform.system()} {platform.release()}"
    )
    print(
        f"load      load average at start {load_start[0]:.2f} {load_start[1]:.2f} "
        f"{load_start[2]:.2f} (all CPUs {100 * busy:.0f}% busy in the second before); "
        f"at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}"
    )
    print(
        f"software  python {platform.python_version()}, meshd {version('meshd')}, "
        f"llama-cpp-python {version('llama_cpp_python')}, fastapi {version('fastapi')}"
    )
    size = Path(model_path).stat().st_size / 2**20
    print(f"model     {model} = {model_path} ({size:.0f} MiB)")
    print(
        f"settings  {args.tokens} tokens after a {n_prompt}-token chat prompt, greedy, "
        f"ignore_eos (llama_cpp.server: min_tokens), flash_attn={FLASH_ATTN}, n_threads={threads}, "
        f"n_ctx={N_CTX}, GOMP_SPINCOUNT as meshd's runners; {done} of {args.repeats} "
        f"repeats measured (interleaved), {len(S['ttft'].xs)} of {args.startup_repeats} "
        f"start-up(s) of each kind"
    )
    if busy > 0.5 or load_start[0] > threads / 2:
        print(
            f"WARNING   the machine was busy before the run started ({100 * busy:.0f}% of "
            f"its CPUs); llama.cpp's {threads} threads share the cores with that load, so "
            f"rates are low and ratios unreliable"
        )
    print()

    figures = [
        Figure("1. decode: meshd 1 stage / llama-cpp-python in process",
               paired(S["m1"], S["direct"]), ">= 0.97", lambda v: v >= 0.97),
        Figure("2. decode: meshd 2 stages (loopback) / 1 stage",
               paired(S["m2"], S["m1"]), ">= 0.90", lambda v: v >= 0.90),
        Figure(f"3a. aggregate: meshd {k} streams / 1 stream",
               paired(S["agg8"], S["agg1"]), ">= 2x", lambda v: v >= 2.0, "{:.2f}"),
        Figure(f"3b. aggregate at {k} streams: meshd / llama_cpp.server",
               paired(S["agg8"], S["srv8"]), ">= 2x", lambda v: v >= 2.0, "{:.2f}",
               S["srv8"].error or ""),
        Figure("4. meshd up -> first streamed token, seconds",
               S["ttft"].xs, "<= 5 s", lambda v: v <= 5.0, "{:.2f}",
               S["ttft"].error or "fresh data dir"),
    ]  # fmt: skip
    print("Figures (value = median over repeats of the paired ratio; spread = min-max)")
    print(
        table(
            [f.row() for f in figures],
            ["figure", "value", "spread", "goal", "result", "note"],
        )
    )

    def raw(keys: list[str], title: str) -> None:
        rows = []
        for key in keys:
            if key not in S:
                continue
            s = S[key]
            if not s.xs:
                rows.append([s.label, "-", "-", s.error or "not measured"])
                continue
            f = "{:.2f}" if s.unit == "s" else "{:.1f}"
            rows.append([s.label, f.format(med(s.xs)), spread(s.xs, f), s.error or ""])
        print()
        print(title)
        print(table(rows, ["what", "median", "min-max", "note"]))

    raw(
        ["direct", "direct_t1", "stage", "bare", "m1", "m2", "srv1"],
        "Decode rate, tok/s: tokens after the first / time from the first to the last, "
        "at the client",
    )
    raw(
        ["agg1", "agg8", "srv8", "stage1_agg", "stage8_agg"],
        "Aggregate, tok/s: every stream's tokens / time from the first request to the last token",
    )
    raw(["ttft", "ttft_warm"], "Start-up to first streamed token, seconds")

    # ---- where time goes ---------------------------------------------------------------
    def per_tok(series: Series) -> str:
        v = med(series.xs)
        return f"{1000 / v:.2f}" if series.xs and v > 0 else "-"

    def mm(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "-"

    print()
    print("Where the time per token goes, 1 stream (ms/token, median over repeats)")
    rows = [["llama-cpp-python Llama.generate, in process", per_tok(S["direct"]), ""]]
    if "direct_t1" in S:
        rows.append(["  the same, one thread fewer", per_tok(S["direct_t1"]), ""])
    rows.append(["meshd's LlamaStage + Sampler, in process", per_tok(S["stage"]), ""])
    rows.append(["meshd's runner alone over ZeroMQ, at the zmq client", per_tok(S["bare"]), ""])
    nostream = metrics[0].mean_ms("itl")
    rows.append(["meshd 1 stage, not streamed: inter-token time at the API node", mm(nostream), ""])
    for n_st in (1, 2):
        m = metrics[n_st]
        itl, over = m.mean_ms("itl"), m.mean_ms("overhead")
        compute = itl - n_st * over if itl is not None and over is not None else None
        rows += [
            [f"meshd {n_st} stage(s): runner engine compute (ITL at API node - overhead)",
             mm(compute), "summed over stages"],
            [f"meshd {n_st} stage(s): overhead per hop, from /metrics", mm(over),
             f"{n_st} hop(s) per token"],
            [f"meshd {n_st} stage(s): inter-token time at the API node", mm(itl), ""],
            [f"meshd {n_st} stage(s): inter-token time at the client",
             per_tok(S["m1" if n_st == 1 else "m2"]), ""],
        ]  # fmt: skip
    print(table(rows, ["where", "ms/token", "note"]))

    print()
    print(
        f"CPU time per generated token, all threads of each process (ms/token, median "
        f"over repeats; {threads} cores give {threads} ms of CPU per ms of wall time)"
    )
    rows = []
    for scope, title in (
        ("direct", "llama-cpp-python in process"),
        ("bare", "meshd runner alone over ZeroMQ"),
        ("m1", "meshd 1 stage, 1 stream"),
        ("m1c", "meshd 1 stage, 1 request not streamed"),
        ("m2", "meshd 2 stages, 1 stream"),
        ("m8", f"meshd 1 stage, {k} streams"),
    ):
        wall = cpu.wall_ms(scope)
        if wall is None:
            continue
        total = 0.0
        for g in cpu.groups(scope):
            v = cpu.ms(scope, g)
            total += v or 0.0
            pre = cpu.preempted(scope, g)
            rows.append([title, g, mm(v), f"{pre:.2f}" if pre is not None else "-"])
        rows.append([title, "all of the above", mm(total), ""])
        rows.append([title, f"wall time x {threads} cores", mm(wall * threads), ""])
    print(table(rows, ["run", "process", "CPU ms/token", "preempted/token"]))

    if startups:
        print()
        print("Start-up timeline, fresh data dir (seconds after exec of meshd up; median)")
        keys = [key for key in startups[0].marks if all(key in s.marks for s in startups)]
        keys.sort(key=lambda key: med([s.marks[key] for s in startups]))
        print(
            table(
                [[key, f"{med([s.marks[key] for s in startups]):.2f}"] for key in keys],
                ["event (arrival of its log line)", "s"],
            )
        )
    for n in notes:
        print(f"note: {n}")
    kept = f"; logs in {tmp}" if args.keep_logs else ""
    print(f"\ntotal run time {time.perf_counter() - t_run:.0f} s{kept}")
    return 0


def record(m: MetricSeries, before: dict, after: dict, model: str, n_stages: int) -> None:
    """Add one request's histograms (between two scrapes) to ``m``."""
    m.add("itl", metric_delta(before, after, "meshd_inter_token_seconds", model=model))
    m.add("overhead", metric_delta(before, after, "meshd_pipeline_overhead_seconds", model=model))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="repeats per figure (default 3)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    p.add_argument("--startup-repeats", type=int, help="start-ups timed (default --repeats)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model (default %(default)s)")
    p.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="seconds: start no repeat that would end past 3/4 of it, no start-up past "
        "it (default %(default)s; a loaded machine then gets fewer repeats, noted)",
    )
    p.add_argument("--quick", action="store_true", help="2 repeats, 64 tokens, 1 start-up")
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary dir")
    add_worker_args(p)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.quick:
        args.repeats, args.tokens = min(args.repeats, 2), min(args.tokens, 64)
        args.startup_repeats = args.startup_repeats or 1
    args.repeats = max(1, args.repeats)
    args.startup_repeats = max(1, args.startup_repeats or args.repeats)
    return run_measure("meshd-bench-", args.keep_logs, lambda tmp: measure(args, tmp))


if __name__ == "__main__":
    raise SystemExit(main())

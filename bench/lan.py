"""meshd split over a LAN with a fixed delay, against one node and llama.cpp RPC.

    python bench/lan.py                      # 0.5 and 5 ms RTT, 3 prompts a set (~5 min)
    python bench/lan.py --quick              # 1 prompt a set, 64 tokens
    python bench/lan.py --rtt 5 --skip rpc
    python bench/lan.py --draft-layers 30    # the whole model drafting: a ceiling
    python bench/lan.py --temperature 0.8    # sampled, as chat apps ask (seeded per prompt)

Needs root (network namespaces, a TUN device). Two hosts, a (10.77.1.2) and b
(10.77.2.2), each in a network namespace of its own, joined by a router namespace whose
forwarding passes every packet through a user-space relay that holds it RTT/2 in each
direction (``bench/_delay.py``; this kernel has no ``sch_netem``). The links are
checked with ``ping -c 20`` at 0 ms (the relay's own cost) and at every RTT.

Rows, at every RTT, on the default model, greedy (``--temperature``: meshd's rows
sampled, with a seed per prompt, so each row writes the same text), fixed-length
answers (``ignore_eos`` for meshd; llama.cpp ignores EOS in ``Llama.generate``):

* meshd 1 stage: a one-node cluster of its own on host a (``speculate: false``);
* meshd 2 stages a -> b, without speculation and with prompt lookup
  (``speculate: false`` / ``true``);
* meshd 2 stages a -> b with a draft model: a cluster of its own (nodes a2 on a, b2 on
  b), the default model cut to its first ``--draft-layers`` layers (raw tensors, same
  tokens) placed on a2 alone and named as the target's ``draft`` (``speculate: true``:
  prompt lookup where it matches, the draft model elsewhere). 30 layers (the whole
  model drafting for itself: its greedy drafts all accepted) is a ceiling on the
  drafts, not on the speed, as it computes as much as the target on a's CPUs;
* llama.cpp RPC 2-way: llama-cpp-python in a process on a, the last half of the layers
  and the head on a ``ggml-rpc-server`` on b (built by bench/_rpc.py), timed in that
  process (``llama_cpp.server`` needs packages this machine may lack).

Three prompt sets: chat (short questions), code edit (a ~40-line function to repeat
with a rename or a docstring: the answer quotes its input) and summarise (a ~300-word
paragraph). The client runs on host a (this process enters its namespace), as an app
on the first machine would. Each host gets half the CPUs' worth of threads
(``--threads``), ``--pin`` pins it to that half. Every subject is up at once and each
prompt runs through all of them in a rotating order. Per row and set: median decode
tok/s and TTFT over the prompts, then ratios paired prompt by prompt and the goals
(see bench/README.md). A benchmark: it prints figures and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import _delay
import httpx
from _common import (
    FLASH_ATTN,
    N_CTX,
    PROCS,
    READY,
    Node,
    OthersMeter,
    Proc,
    Stream,
    chat_payload,
    counted,
    cpu_model,
    http_client,
    log,
    med,
    run_measure,
    scrape,
    spread,
    stop_all,
    stop_process,
    stream_chat,
    table,
    version,
    wait_live,
)
from _common import place as place_instance

from meshd.models.resolve import DEFAULT_MODEL, resolve_model

REPO = Path(__file__).resolve().parents[1]

# -- prompt sets ------------------------------------------------------------------------

CHAT = [
    "What is the capital of Australia, and why was that city chosen?",
    "Give me three practical tips for sleeping better.",
    "How does a refrigerator keep food cold?",
]

CODE_1 = """def summarize_orders(orders, currency):
    totals = {}
    counts = {}
    refunds = 0
    for order in orders:
        if order.status == "cancelled":
            continue
        customer = order.customer_id
        amount = order.amount
        if order.currency != currency:
            amount = convert(amount, order.currency, currency)
        if order.status == "refunded":
            refunds += amount
            continue
        totals[customer] = totals.get(customer, 0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    report = []
    for customer, total in totals.items():
        average = total / counts[customer]
        report.append(
            {
                "customer": customer,
                "total": round(total, 2),
                "orders": counts[customer],
                "average": round(average, 2),
            }
        )
    report.sort(key=lambda row: row["total"], reverse=True)
    best = report[0]["customer"] if report else None
    return {
        "currency": currency,
        "customers": report,
        "refunds": round(refunds, 2),
        "best_customer": best,
    }
"""

CODE_2 = """def load_settings(path, defaults, environ):
    settings = dict(defaults)
    errors = []
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                errors.append(f"line {number}: no '=' in {line!r}")
                continue
            key, value = line.split("=", 1)
            key = key.strip().lower()
            value = value.strip()
            if key not in defaults:
                errors.append(f"line {number}: unknown key {key!r}")
                continue
            kind = type(defaults[key])
            try:
                if kind is bool:
                    settings[key] = value.lower() in ("1", "true", "yes", "on")
                else:
                    settings[key] = kind(value)
            except ValueError:
                errors.append(f"line {number}: {key} wants {kind.__name__}")
    for key in defaults:
        name = "APP_" + key.upper()
        if name in environ:
            settings[key] = type(defaults[key])(environ[name])
    if errors:
        raise ValueError("\\n".join(errors))
    return settings
"""

CODE_3 = """def shortest_path(grid, start, goal):
    rows = len(grid)
    cols = len(grid[0]) if rows else 0
    queue = deque([start])
    previous = {start: None}
    while queue:
        cell = queue.popleft()
        if cell == goal:
            break
        row, col = cell
        for d_row, d_col in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            next_row = row + d_row
            next_col = col + d_col
            if not (0 <= next_row < rows and 0 <= next_col < cols):
                continue
            if grid[next_row][next_col] == "#":
                continue
            neighbour = (next_row, next_col)
            if neighbour in previous:
                continue
            previous[neighbour] = cell
            queue.append(neighbour)
    if goal not in previous:
        return None
    path = []
    cell = goal
    while cell is not None:
        path.append(cell)
        cell = previous[cell]
    path.reverse()
    # The path runs from start to goal, both included.
    return path
"""

CODE = [
    f"Rewrite this function with the variable `totals` renamed to `spent`. "
    f"Answer with the code only.\n\n{CODE_1}",
    f"Add a docstring to this function and rename `settings` to `config`. "
    f"Answer with the code only.\n\n{CODE_2}",
    f"Rewrite this function with `previous` renamed to `came_from`. "
    f"Answer with the code only.\n\n{CODE_3}",
]

TEXT_1 = (
    "The first bicycles appeared in the early nineteenth century, when a German "
    "inventor named Karl Drais built a wooden machine with two wheels and no pedals. "
    "Riders sat on a saddle and pushed themselves along with their feet, gliding down "
    "gentle slopes. The machine was called a running machine or a dandy horse, and it "
    "became a fashion among wealthy young men in Paris and London for a few years "
    "before falling out of favour because it was hard to steer on rough roads. In the "
    "1860s French mechanics attached pedals and cranks directly to the front wheel. "
    "These velocipedes were made of iron and wood and were so uncomfortable on cobbled "
    "streets that people called them boneshakers. To go faster with each turn of the "
    "pedals, makers enlarged the front wheel, which led to the high wheeler of the "
    "1870s, with a front wheel as tall as a grown man. It was fast but dangerous: a "
    "rider who hit a stone could be thrown over the handlebars head first. The safety "
    "bicycle of the 1880s solved this problem with two wheels of equal size and a chain "
    "that drove the rear wheel, so the rider sat low between the wheels. Soon after, "
    "the pneumatic tyre, patented by John Dunlop in 1888, made the ride smooth. The "
    "result was a machine very close to the bicycles we ride today, and it caused a "
    "boom. Cheap, light and reliable, the bicycle gave ordinary workers a way to travel "
    "to jobs far from home, and it gave many women a new freedom of movement that "
    "changed clothing and social customs. Cycling clubs lobbied for better roads, which "
    "later served the first cars. Many early car and aircraft makers, including the "
    "Wright brothers, started out building and repairing bicycles."
)

TEXT_2 = (
    "Honey begins in the flowers. A forager bee visits hundreds of blossoms on a single "
    "trip, drinking nectar with its long tongue and storing it in a special stomach "
    "called the honey crop, which is separate from the stomach it uses for its own "
    "food. Nectar is mostly water with some sugar, often more than seventy percent "
    "water, so it would spoil quickly if it were stored as it is. Inside the bee, "
    "enzymes start to work on the nectar at once, breaking the complex sugar sucrose "
    "into the simpler sugars glucose and fructose. When the forager returns to the "
    "hive, it passes the nectar to a younger house bee, mouth to mouth. The house bee "
    "chews the nectar for about half an hour, adding more enzymes, and then places a "
    "drop of it in a wax cell of the honeycomb. At this stage the liquid is still too "
    "wet to keep. The bees spread it thinly over the cells so that more of it touches "
    "the air, and they fan their wings hard to move warm air across the comb. Slowly "
    "the water evaporates until the honey holds only about seventeen or eighteen "
    "percent water. At that point it is so thick and so full of sugar that bacteria and "
    "yeasts cannot grow in it, and one of the enzymes also produces a little hydrogen "
    "peroxide, which protects it further. When a cell is full and ripe, the bees seal "
    "it with a cap of fresh wax, like a lid on a jar. A strong colony can store more "
    "than fifty kilograms of honey in a good summer. The bees eat it during the winter, "
    "when no flowers bloom, and beekeepers take only the surplus that the colony does "
    "not need to survive until the spring."
)

TEXT_3 = (
    "At its meeting on Tuesday evening the town council debated for more than three "
    "hours about the future of the old public library on Market Street. The building, "
    "which opened in 1911, needs a new roof, new wiring and a lift before it can meet "
    "current safety and access rules, and the engineers estimate the work at about "
    "four million euros. The mayor proposed closing it and moving the collection to a "
    "smaller space in the new shopping centre at the edge of town, where rent would be "
    "paid by the developer for the first ten years. She argued that the money saved "
    "could pay for longer opening hours, more staff and a larger digital collection. "
    "Several councillors objected. They said that the shopping centre is hard to reach "
    "without a car, that older residents and schoolchildren rely on the central "
    "location, and that the building is part of the town's history. A group of "
    "residents presented a petition with more than two thousand signatures asking the "
    "council to keep the library where it is. The head librarian told the meeting that "
    "visits had grown by fifteen percent in the last two years, mostly because of "
    "homework clubs and language classes for newcomers. A local architect offered a "
    "cheaper plan that would repair the roof and wiring first and add the lift later, "
    "spreading the cost over six years with help from a national heritage fund. In "
    "the end the council voted seven to four to postpone a decision. It asked the "
    "staff to compare the costs of both plans in detail, to apply for the heritage "
    "grant, and to report back at the March meeting. Until then the library will stay "
    "open with its usual hours."
)

SUMMARISE = [f"Summarise this text in three sentences.\n\n{t}" for t in (TEXT_1, TEXT_2, TEXT_3)]

SETS = {"chat": CHAT, "code edit": CODE, "summarise": SUMMARISE}

# -- the subjects -------------------------------------------------------------------------


@dataclass
class Cell:
    """One row at one RTT on one prompt set: a stream per prompt (None: failed)."""

    streams: list[Stream | None] = field(default_factory=list)
    others: list[float] = field(default_factory=list)
    drafted: float = 0.0
    accepted: float = 0.0
    #: Of those, the draft model's (``proposer="model"``).
    model_drafted: float = 0.0
    model_accepted: float = 0.0
    #: Drafted steps that held whole with the next one already sent.
    chained: float = 0.0

    def ok(self) -> list[Stream]:
        return [s for s in self.streams if s is not None]

    @property
    def tok_s(self) -> float:
        return med([s.decode_tok_s for s in self.ok()])

    @property
    def ttft_ms(self) -> float:
        return 1000 * med([s.ttft for s in self.ok()])


#: Row keys, in print order, with their labels.
ROWS = {
    "m1": "meshd 1 stage (a alone)",
    "m2": "meshd 2 stages a->b, no speculation",
    "m2spec": "meshd 2 stages a->b, prompt lookup",
    "m2draft": "meshd 2 stages a->b, draft model",
    "rpc": "llama.cpp RPC 2-way (a + rpc-server on b)",
}
MEASURED = ("m1", "m2", "m2spec", "m2draft", "rpc")


#: Host index -> the CPUs its processes are pinned to (``taskset -c``); empty: unpinned.
PIN: dict[int, str] = {}


def host_argv(host: _delay.Host, argv: list[str]) -> list[str]:
    """``argv`` run inside ``host``, on its own CPUs when the hosts are pinned (two
    machines on a LAN do not share cores; and an OpenMP pool spread over a core someone
    else holds waits at every barrier). Runners inherit the affinity, and meshd sizes
    their thread pools from it."""
    cpus = PIN.get(host.index)
    return host.argv(["taskset", "-c", cpus, *argv] if cpus else argv)


def node_env() -> dict[str, str]:
    """The environment of the processes started in the hosts: meshd from this tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def start_node(
    tmp: Path,
    host: _delay.Host,
    name: str,
    cluster: str,
    peers: list[tuple[str, int]],
) -> Node:
    """``meshd up`` inside ``host``: the mesh on its LAN address, the API on its
    loopback (the client runs in host a). Nodes of one cluster share a secret file."""
    secret = tmp / f"{cluster}.secret"
    if not secret.exists():
        from meshd.transport.security import write_secret

        write_secret(secret)
    args = host_argv(host, [
        sys.executable, "-m", "meshd.cli.meshd", "up", "--name", name, "--cluster", cluster,
        "--no-model", "--no-discovery", "--api-port", "0", "--mesh-port", "0",
        "--mesh-host", host.ip, "--data-dir", str(tmp / f"data-{name}"),
        "--secret-file", str(secret),
        *[a for ip, port in peers for a in ("--peer", f"{ip}:{port}")],
    ])  # fmt: skip
    proc = Proc(args, tmp / f"node-{name}.log", env=node_env())
    _, m = proc.wait_line(READY, 90.0)
    return Node(name, proc, m["api"], int(m["mesh"]))


def place(
    client: httpx.Client, node: Node, nodes: list[str], model: str = DEFAULT_MODEL, **extra: str
) -> str:
    """Place ``model`` on ``nodes`` (a stage each), ``extra``: more fields of the body."""
    return place_instance(client, node, model, nodes, 180.0, **extra)


def write_draft(src: Path, dest: Path, n_layers: int) -> Path:
    """The first ``n_layers`` of the llama GGUF ``src``, tensors copied raw (their
    quant type kept), every other key as in ``src``: a draft model with its tokens."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = "llama"
    w = gguf.GGUFWriter(dest, arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = f.types[0]
        value = n_layers if f.name == f"{arch}.block_count" else f.contents()
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def wait_draft(client: httpx.Client, node: Node, target: str, draft: str, timeout: float) -> None:
    """Until ``GET /v1/instances`` on ``node`` shows ``draft`` drafting for ``target``."""
    deadline = time.monotonic() + timeout
    got = None
    while True:
        r = client.get(f"{node.api}/v1/instances")
        r.raise_for_status()
        got = next((i.get("draft") for i in r.json()["data"] if i["id"] == target), None)
        if got == draft:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the target's draft is {got!r} after {timeout:g} s, not {draft}")
        time.sleep(0.2)


def start_draft_cluster(
    client: httpx.Client, tmp: Path, lan: _delay.DelayLan, model_path: Path, n_layers: int
) -> tuple[Node, str]:
    """Cluster lan2: a2 on a, b2 on b; the draft model (``n_layers`` of the default
    one) on a2, the target in 2 stages a2 -> b2 naming it. (a2, note)."""
    a, b = lan.hosts
    draft_path = write_draft(model_path, tmp / f"draft-{n_layers}l.gguf", n_layers)
    na2 = start_node(tmp, a, "a2", "lan2", [])
    start_node(tmp, b, "b2", "lan2", [(a.ip, na2.mesh_port)])
    wait_live(client, na2, {"a2", "b2"}, 60.0)
    draft = place(client, na2, ["a2"], str(draft_path))
    target = place(client, na2, ["a2", "b2"], draft=str(draft_path))
    wait_draft(client, na2, target, draft, 60.0)
    mb = draft_path.stat().st_size / 2**20
    note = (
        f"draft model: the default model's first {n_layers} layers ({mb:.0f} MiB, raw "
        f"tensors) on a2, drafting for a2 -> b2 (instance {draft})"
    )
    return na2, note


def wait_port(ip: str, port: int, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection((ip, port), 0.5):
            return
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.proc.returncode}: {proc.tail(5)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {ip}:{port}")
        time.sleep(0.1)


def meshd_subject(
    client: httpx.Client, node: Node, speculate: bool, tokens: int, temperature: float = 0.0
):
    """Streams from ``node``'s API on the default model. A ``temperature`` above 0
    samples with a seed fixed per prompt: every row then writes the same text (a seeded
    answer is the same with and without drafts), so the rows still pair up."""

    def run(prompt: str) -> Stream:
        msgs = [{"role": "user", "content": prompt}]
        p = chat_payload(DEFAULT_MODEL, tokens, meshd=True, messages=msgs)
        p["speculate"] = speculate
        if temperature > 0:
            p["temperature"] = temperature
            p["seed"] = zlib.crc32(prompt.encode())
        return stream_chat(client, node.api, p)

    return run


def start_rpc(
    tmp: Path, lan: _delay.DelayLan, model_path: Path, n_layers: int, threads: int
) -> tuple[RpcWorker, Proc, str]:
    """ggml-rpc-server on b; on a, llama-cpp-python offloading the last half to it."""
    import _rpc

    from meshd.engines.threads import runner_env

    a, b = lan.hosts
    bin_dir = _rpc.ensure_built(log=log)
    port = 50052
    server = Proc(
        host_argv(b, [str(bin_dir / _rpc.SERVER), "-H", b.ip, "-p", str(port), "-t", str(threads)]),
        tmp / "rpc-server.log",
        env=runner_env(),
    )
    wait_port(b.ip, port, server, 30.0)
    offload = n_layers - n_layers // 2 + 1
    worker = RpcWorker(tmp, a, model_path, f"{b.ip}:{port}", offload, threads)
    note = (
        f"llama.cpp RPC: llama-cpp-python {version('llama_cpp_python')} in a process on a "
        f"(layers 0-{n_layers // 2 - 1}), layers {n_layers // 2}-{n_layers - 1} + head on "
        f"b's ggml-rpc-server, {threads} threads each; timed in process (no HTTP)"
    )
    return worker, server, note


# -- the run ------------------------------------------------------------------------------


def measure(tmp: Path, args: argparse.Namespace) -> int:
    ok, why = _delay.available()
    if not ok:
        print(f"bench/lan.py needs network namespaces and a TUN device: {why}")
        return 0
    from meshd.models.facts import read_facts

    t_run = time.perf_counter()
    n_prompts = 1 if args.quick else args.prompts
    tokens = 64 if args.quick else args.tokens
    sets = {k: v[:n_prompts] for k, v in SETS.items()}
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    model_path = Path(resolve_model(DEFAULT_MODEL).path)
    n_layers = read_facts(model_path, DEFAULT_MODEL).n_layers
    if not 1 <= args.draft_layers <= n_layers:
        print(f"--draft-layers must be 1 to {n_layers}")
        return 0
    # Each host gets half the CPUs' worth of threads (two machines do not share cores),
    # and with --pin those very CPUs. Unpinned, the scheduler moves them away from
    # whatever else runs on this machine; pinned, a host whose CPU someone else uses
    # runs at that CPU's leftover.
    cpus = sorted(os.sched_getaffinity(0))
    threads = args.threads or max(1, len(cpus) // 2)
    os.environ["MESHD_THREADS"] = str(threads)  # the nodes' runners read it
    if args.pin and len(cpus) >= 2 and shutil.which("taskset"):
        half = len(cpus) // 2
        PIN[0] = ",".join(map(str, cpus[:half]))
        PIN[1] = ",".join(map(str, cpus[half : 2 * half]))
    cells: dict[tuple[str, float, str], Cell] = {}
    notes: list[str] = []
    missing: dict[str, str] = {}
    load0 = os.getloadavg()

    with _delay.DelayLan(n=2, prefix="mdlan") as lan:
        a, b = lan.hosts
        # ---- the links -----------------------------------------------------------------
        pings = []
        lan.set_rtt(0)
        lan.ping(0, 1, count=3)  # neighbours resolved before anything is timed
        gw = lan.ping_ip(0, f"{lan.subnet}.1.1", count=20)
        for rtt in [0.0, *args.rtt]:
            lan.set_rtt(rtt)
            pings.append(lan.ping(0, 1, count=20))
            log(f"ping a->b at {rtt:g} ms: avg {pings[-1].avg_ms:.3f} ms")
        # This process is the client on host a from here on (127.0.0.1 is a's).
        a.enter()
        client = http_client()
        worker: RpcWorker | None = None
        try:
            # ---- every subject up at once, so each prompt runs through all in turn -----
            subjects = {}
            if "m1" not in skip:
                log("starting meshd node s on a (a one-node cluster of its own)")
                ns = start_node(tmp, a, "s", "solo", [])
                place(client, ns, ["s"])
                subjects["m1"] = meshd_subject(client, ns, False, tokens, args.temperature)
            na = None
            if not {"m2", "m2spec"} <= skip:
                log("starting meshd nodes a and b, placing 2 stages a -> b")
                na = start_node(tmp, a, "a", "lan", [])
                start_node(tmp, b, "b", "lan", [(a.ip, na.mesh_port)])
                wait_live(client, na, {"a", "b"}, 60.0)
                place(client, na, ["a", "b"])
                for key in ("m2", "m2spec"):
                    if key not in skip:
                        subjects[key] = meshd_subject(
                            client, na, key == "m2spec", tokens, args.temperature
                        )
            # The api node whose /metrics count each drafting row's drafts.
            counts = {"m2spec": na}
            if "m2draft" not in skip:
                log(f"starting meshd nodes a2 and b2, a {args.draft_layers}-layer draft on a2")
                try:
                    na2, note = start_draft_cluster(client, tmp, lan, model_path, args.draft_layers)
                    notes.append(note)
                    counts["m2draft"] = na2
                    subjects["m2draft"] = meshd_subject(client, na2, True, tokens, args.temperature)
                except Exception as e:
                    missing["m2draft"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
                    log(f"m2draft: {missing['m2draft']}")
            if "rpc" not in skip:
                log("starting ggml-rpc-server on b and llama-cpp-python with RPC on a")
                try:
                    worker, _, note = start_rpc(tmp, lan, model_path, n_layers, threads)
                    notes.append(note)
                    subjects["rpc"] = lambda prompt: worker.run(prompt, tokens)
                except Exception as e:
                    missing["rpc"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
                    log(f"rpc: {missing['rpc']}")
            # ---- the rounds ------------------------------------------------------------
            keys = list(subjects)
            turn = 0
            try:
                for rtt in args.rtt:
                    lan.set_rtt(rtt)
                    for set_name, prompts in sets.items():
                        for i, prompt in enumerate(prompts):
                            turn += 1
                            order = keys[turn % len(keys) :] + keys[: turn % len(keys)]
                            for key in order:
                                cell = cells.setdefault((key, rtt, set_name), Cell())
                                api = counts.get(key)
                                before = scrape(client, api) if api else {}
                                s, share = timed(subjects[key], prompt, args)
                                if before:
                                    after = scrape(client, api)
                                    drafted = "meshd_draft_tokens_total"
                                    accepted = "meshd_draft_tokens_accepted_total"
                                    cell.drafted += counted(before, after, drafted)
                                    cell.accepted += counted(before, after, accepted)
                                    cell.model_drafted += counted(
                                        before, after, drafted, proposer="model"
                                    )
                                    cell.model_accepted += counted(
                                        before, after, accepted, proposer="model"
                                    )
                                    cell.chained += counted(
                                        before, after, "meshd_draft_steps_chained_total"
                                    )
                                cell.streams.append(s)
                                cell.others.append(share)
                                what = (f"{s.decode_tok_s:.1f} tok/s, ttft {1000 * s.ttft:.0f} ms"
                                        if s else "failed")  # fmt: skip
                                log(f"{rtt:g} ms {set_name} #{i} {key}: {what}, "
                                    f"others {100 * share:.0f}% CPU")  # fmt: skip
            except (KeyboardInterrupt, SystemExit) as e:
                # Stopped (Ctrl-C, SIGTERM): everything is stopped below, and what was
                # measured is still printed.
                notes.append(f"interrupted ({type(e).__name__}): the figures are partial")
        finally:
            client.close()
            if worker is not None:
                worker.close()
            stop_all()

    report(args, sets, tokens, cells, pings, gw, notes, missing, threads, load0, t_run)
    return 0


def timed(run, prompt: str, args: argparse.Namespace) -> tuple[Stream | None, float]:
    """One stream; again (up to ``--retries`` times) while other processes used more
    than ``--max-others`` of the CPUs during it; the least shared attempt is kept."""
    best: tuple[Stream | None, float] = (None, float("inf"))
    for _ in range(1 + args.retries):
        meter = OthersMeter()
        try:
            s = run(prompt)
        except Exception as e:
            log(f"stream failed: {type(e).__name__}: {e}")
            return None, float("nan")
        share = meter.share()
        if best[0] is None or share < best[1]:
            best = (s, share)
        if not share > args.max_others:
            break
    return best


class RpcWorker:
    """``lan.py --rpc-worker`` inside host a: llama-cpp-python holding the model with
    the last layers on the RPC server, one JSON line in and out per prompt."""

    def __init__(
        self, tmp: Path, host: _delay.Host, model: Path, ep: str, offload: int, threads: int
    ) -> None:
        from meshd.engines.threads import runner_env

        env = {**runner_env(), "PYTHONPATH": node_env()["PYTHONPATH"]}
        argv = [sys.executable, str(Path(__file__).resolve()), "--rpc-worker", str(model),
                ep, str(offload), str(threads)]  # fmt: skip
        with open(tmp / "rpc-worker.log", "wb") as err:
            self.p = subprocess.Popen(
                host_argv(host, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env=env, start_new_session=True, text=True,
            )  # fmt: skip
        PROCS.append(self.p)
        self.read()

    def read(self) -> dict:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the RPC worker exited {self.p.wait()} (see rpc-worker.log)")
        return json.loads(line)

    def run(self, prompt: str, tokens: int) -> Stream:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"prompt": prompt, "tokens": tokens}) + "\n")
        self.p.stdin.flush()
        return Stream(**self.read())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.p.stdin is not None
            self.p.stdin.close()
            self.p.wait(5)
        stop_process(self.p)


def rpc_worker_main(argv: list[str]) -> int:
    """``--rpc-worker MODEL HOST:PORT OFFLOAD THREADS``: see :class:`RpcWorker`. Each
    answer is greedy, ``tokens`` long whatever EOS says (as ``ignore_eos``), timed from
    the line's arrival; the text of every token is detokenized, as a stream needs."""
    import _rpc
    import llama_cpp

    from meshd.models.chat import CHATML_TEMPLATE, chat_template_at, render_chat

    model, ep, offload, threads = argv[0], argv[1], int(argv[2]), int(argv[3])
    n = _rpc.load_rpc_backend(_rpc.ensure_built(log=lambda m: None), [ep])
    llm = llama_cpp.Llama(
        model, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, flash_attn=FLASH_ATTN,
        n_gpu_layers=offload, verbose=False,
    )  # fmt: skip
    template = chat_template_at(model) or CHATML_TEMPLATE
    print(json.dumps({"ready": True, "devices": n}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        t_sent = time.perf_counter()
        text = render_chat(template, [{"role": "user", "content": cmd["prompt"]}],
                           add_generation_prompt=True)  # fmt: skip
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        ts: list[float] = []
        # Every prompt computed whole, as meshd does for greedy requests: without the
        # reset, llama-cpp-python reuses the longest prefix of the previous prompt (all
        # of it when a stream is measured again).
        llm.reset()
        # Llama.generate yields tokens until told to stop: EOS does not end it.
        for tok in llm.generate(ids, temp=0.0, reset=False):
            llm.detokenize([tok])
            ts.append(time.perf_counter())
            if len(ts) >= cmd["tokens"]:
                break
        out = {"t_sent": t_sent, "t_first": ts[0], "t_last": ts[-1], "t_end": ts[-1]}
        print(json.dumps({**out, "tokens": len(ts), "events": len(ts)}), flush=True)
    return 0


# -- the report ---------------------------------------------------------------------------


def paired(cells: dict, x: str, y: str, rtt: float, s: str) -> list[float]:
    """x / y decode tok/s, prompt by prompt (the two ran back to back)."""
    cx, cy = cells.get((x, rtt, s)), cells.get((y, rtt, s))
    if not cx or not cy:
        return []
    return [
        u.decode_tok_s / v.decode_tok_s
        for u, v in zip(cx.streams, cy.streams, strict=False)
        if u is not None and v is not None and v.decode_tok_s > 0
    ]


def report(
    args: argparse.Namespace,
    sets: dict[str, list[str]],
    tokens: int,
    cells: dict[tuple[str, float, str], Cell],
    pings: list[_delay.Ping],
    gw: _delay.Ping,
    notes: list[str],
    missing: dict[str, str],
    threads: int,
    load0: tuple[float, float, float],
    t_run: float,
) -> None:
    n = len(next(iter(sets.values())))
    how = (
        f"at temperature {args.temperature:g}, seeded (meshd)" if args.temperature > 0 else "greedy"
    )
    others = [x for c in cells.values() for x in c.others if x == x]
    print()
    print(
        f"bench/lan.py: {DEFAULT_MODEL}, {tokens} tokens {how}, {n} prompt(s) a set, "
        f"{threads} thread(s) a runner, "
        f"{'CPUs ' + PIN[0] + ' for a, ' + PIN[1] + ' for b' if PIN else 'unpinned'}; "
        f"{os.cpu_count()} CPUs ({cpu_model()}), load "
        f"{load0[0]:.2f} at start, other processes' CPU share during streams median "
        f"{100 * med(others):.0f}%; {time.perf_counter() - t_run:.0f} s"
    )
    print()
    print("links: ping -c 20 from a to b through the delay relay, ms (RTT/2 held each way)")
    base = [
        "a -> router (no relay)",
        f"{gw.received}/{gw.sent}",
        *[f"{x:.3f}" for x in (gw.min_ms, gw.avg_ms, gw.max_ms, gw.mdev_ms)],
        "",
    ]
    print(table([base, *[p.row() for p in pings]], _delay.PING_HEADER))
    print()
    print("median over the prompts of each set: decode tok/s, time to first token (ms)")
    header = ["RTT", "row"]
    for name in sets:
        header += [f"{name} tok/s", "TTFT"]
    header.append("drafts accepted (code edit)")
    rows = []
    for rtt in args.rtt:
        for key, label in ROWS.items():
            r = [f"{rtt:g} ms", label]
            if key in missing or not any(cells.get((key, rtt, s)) for s in sets):
                rows.append([*r, "skipped", *[""] * (2 * len(sets) - 1), ""])
                continue
            for name in sets:
                c = cells.get((key, rtt, name))
                r += [f"{c.tok_s:.1f}", f"{c.ttft_ms:.0f}"] if c and c.ok() else ["failed", ""]
            c = cells.get((key, rtt, "code edit"))
            acc = f"{c.accepted / c.drafted:.0%} of {c.drafted:.0f}" if c and c.drafted else ""
            if key == "m2draft" and c:
                acc += f" ({c.model_accepted:.0f} of {c.model_drafted:.0f} by the model)"
            if c and c.chained:
                acc += f", {c.chained:.0f} steps chained"
            r.append(acc)
            rows.append(r)
    print(table(rows, header))
    for note in notes:
        print(f"  {note}")
    for key, why in missing.items():
        print(f"  {ROWS[key]}: skipped: {why}")
    for rtt in args.rtt:
        by_set = [
            f"{name} {c.accepted / c.drafted:.0%} of {c.drafted:.0f} ({c.chained:.0f} chained)"
            for name in sets
            if (c := cells.get(("m2spec", rtt, name))) and c.drafted
        ]
        if by_set:
            print(f"  prompt lookup row at {rtt:g} ms, drafts accepted: {'; '.join(by_set)}")
    for rtt in args.rtt:
        c = [cells[k] for k in cells if k[0] == "m2draft" and k[1] == rtt]
        drafted, accepted = sum(x.drafted for x in c), sum(x.accepted for x in c)
        by_model = sum(x.model_drafted for x in c)
        if drafted:
            kept = sum(x.model_accepted for x in c) / by_model if by_model else 0.0
            print(
                f"  draft model row at {rtt:g} ms, every set: {accepted / drafted:.0%} of "
                f"{drafted:.0f} drafts accepted; {by_model:.0f} drafted by the model "
                f"({kept:.0%} of them accepted), the rest by prompt lookup"
            )
    print()
    print("ratios of decode tok/s, paired prompt by prompt, median (min-max)")
    pairs = [
        ("m2", "m1"), ("m2spec", "m1"), ("m2spec", "m2"), ("m2draft", "m1"), ("m2draft", "m2"),
        ("m2", "rpc"), ("m2spec", "rpc"),
    ]  # fmt: skip
    rrows = []
    for rtt in args.rtt:
        for name in sets:
            r = [f"{rtt:g} ms", name]
            for x, y in pairs:
                v = paired(cells, x, y, rtt, name)
                r.append(f"{med(v):.2f}x ({spread(v, '{:.2f}')})" if v else "-")
            rrows.append(r)
    print(table(rrows, ["RTT", "prompts", "2 stages / 1 stage", "2 st. spec / 1 stage",
                        "spec / plain", "2 st. draft / 1 stage", "draft / plain",
                        "2 stages / RPC", "2 st. spec / RPC"]))  # fmt: skip
    print()
    if 5.0 not in args.rtt:
        print("the goals are judged at 5 ms RTT (not in --rtt)")
        return
    goals = []
    for label, (x, y), goal in (
        ("meshd 2 stages + speculation / meshd 1 stage", ("m2spec", "m1"), 1.0),
        ("meshd 2 stages + speculation / llama.cpp RPC 2-way", ("m2spec", "rpc"), 2.5),
        ("meshd 2 stages + draft model / meshd 1 stage", ("m2draft", "m1"), 1.0),
    ):
        v = paired(cells, x, y, 5.0, "code edit")
        met = "not measured" if not v else ("met" if med(v) >= goal else "NOT met")
        shown = f"{med(v):.2f}x" if v else "-"
        goals.append(["5 ms", f"{label}, code edit", shown, f">= {goal}x", met])
    print(table(goals, ["RTT", "goal", "ratio", "target", ""]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt", type=float, nargs="+", default=[0.5, 5.0],
                   help="round-trip times to emulate, ms (default: 0.5 5)")  # fmt: skip
    p.add_argument("--tokens", type=int, default=96, help="tokens an answer (default 96)")
    p.add_argument("--prompts", type=int, default=3, help="prompts a set (1-3, default 3)")
    p.add_argument("--quick", action="store_true", help="1 prompt a set, 64 tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sample meshd's answers "
                   "at this temperature, seeded per prompt (default 0: greedy)")  # fmt: skip
    p.add_argument("--skip", default="", help="comma-separated rows to leave out: m1, m2, "
                   "m2spec, m2draft, rpc")  # fmt: skip
    p.add_argument("--draft-layers", type=int, default=6, help="layers of the draft model, "
                   "the default model's first ones (default 6; 30: all, a ceiling)")  # fmt: skip
    p.add_argument(
        "--retries",
        type=int,
        default=1,
        help="measure a stream again while others used the CPUs (default 1)",
    )
    p.add_argument(
        "--max-others",
        type=float,
        default=0.3,
        help="share of the CPUs others may use during a stream (default 0.3)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads of each runner, rpc-server and llama-cpp-python "
        "(default: half the CPUs, one host's share)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="pin host a's processes to the first half of the CPUs, b's to the second (taskset)",
    )
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--rpc-worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rpc_worker:
        return rpc_worker_main(args.rpc_worker)
    return run_measure("meshd-lan-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    sys.exit(main())

"""``meshctl top``'s pure renderer, ``--node`` parsing, and how meshctl fails.

The renderer draws a ``GET /v1/cluster`` answer and a ``GET /v1/instances`` answer;
here the second is made by the node's own code (``meshd.api.instance_view``) from a
:class:`ClusterView` holding what the first one says, as a node holding that state
would answer."""

from __future__ import annotations

import copy
import io
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
from rich.console import Console

from meshd.api.instance_view import instance_list
from meshd.cli.client import NodeClient, NodeError, NodeUnreachable, parse_node
from meshd.cli.meshctl import main
from meshd.cli.top import mem_bar, render, run_top
from meshd.crdt.views import Health, Instance, NodeCard
from meshd.node.cluster import CRASH_LOOP, FETCH_FAILED, MODEL_MISSING, REFUSED, ClusterView

GIB = 1024**3
NOW_MS = 1_700_000_100_000

A = "a1b2c3d4e5f60718"
B = "b2c3d4e5f6071829"
C = "c3d4e5f60718293a"


GPU = {"backend": "mlx-cuda", "name": "RTX 4090", "mem_total": 24 * GIB, "mem_free": 23 * GIB}


def _card(nid: str, name: str, **over: object) -> dict:
    card = {
        "id": nid,
        "name": name,
        "incarnation": "inc-" + nid[:4],
        "cluster": "home",
        "version": "0.1.0",
        "os": "linux",
        "arch": "x86_64",
        "cpu_count": 8,
        "mem_total": 16 * GIB,
        "mem_available": 10 * GIB,
        "backends": ["llama_cpp-cpu"],
        "addresses": ["192.168.1.10"],
        "mesh_port": 7471,
        "pub_port": 7472,
        "api_port": 7470,
        "models": ["qwen2.5-0.5b"],
        "started_ms": NOW_MS - 3_600_000,
    }
    card.update(over)
    return card


CLUSTER = {
    "self": A,
    "cluster": "home",
    "nodes": [
        {
            "id": A,
            "name": "studio",
            "liveness": "alive",
            "heartbeat_age_s": 0.31,
            "card": _card(A, "studio", os="darwin", arch="arm64", backends=["mlx-metal"]),
            "health": {
                "seq": 42,
                "state": "up",
                "mem_available": 4 * GIB,
                "load": 1.25,
                "queue_depth": 1,
                "decode_bps": 31.5e9,
                "synced": 40,
                "runners": [{"instance": "llama-70b", "generation": 2, "state": "ready"}],
            },
        },
        {
            "id": B,
            "name": "tower",
            "liveness": "suspect",
            "heartbeat_age_s": 1.9,
            "card": _card(B, "tower", backends=["llama_cpp-cpu", "mlx-cuda"], devices=[GPU]),
            "health": {
                "seq": 17,
                "load": 0.5,
                "runners": [
                    {"instance": "llama-70b", "generation": 2, "stage": 1, "state": "loading"}
                ],
            },
        },
        {
            "id": C,
            "name": "laptop",
            "liveness": "dead",
            "heartbeat_age_s": 12.0,
            "card": _card(C, "laptop"),
            "health": {
                "seq": 9,
                "runners": [
                    {
                        "instance": "llama-70b",
                        "generation": 1,
                        "stage": 2,
                        "state": "failed",
                        "reason": "out of memory",
                    }
                ],
            },
        },
    ],
    "predicted_tokens_s": {"llama-70b": 12.4},
    "instances": [
        {
            "id": "llama-70b",
            "spec": {"model": "meta-llama/Llama-3.1-70B", "min_nodes": 2},
            "stages": [
                {"node": A, "start": 0, "end": 48, "engine": "mlx"},
                {"node": B, "start": 48, "end": 72, "engine": "llama_cpp"},
                {"node": C, "start": 72, "end": 80, "engine": "llama_cpp"},
            ],
            "generation": 2,
        }
    ],
}


def cluster_view(cluster: dict) -> ClusterView:
    """The view of a node whose ``GET /v1/cluster`` answer is ``cluster``."""
    nodes = cluster["nodes"]
    return ClusterView(
        self_id=cluster["self"],
        cards={n["id"]: msgspec.convert(n["card"], NodeCard) for n in nodes if n.get("card")},
        healths={n["id"]: msgspec.convert(n["health"], Health) for n in nodes if n.get("health")},
        instances={i["id"]: msgspec.convert(i, Instance) for i in cluster["instances"]},
        liveness={n["id"]: n["liveness"] for n in nodes if n.get("liveness")},
        ages={n["id"]: n["heartbeat_age_s"] for n in nodes if n.get("heartbeat_age_s")},
    )


def instances_of(cluster: dict) -> list[dict]:
    """The ``data`` of that node's ``GET /v1/instances``, as JSON carries it."""
    body = msgspec.json.encode(instance_list(cluster_view(cluster)))
    data = json.loads(body)["data"]
    # The node's prediction for one request (its inputs, measured speeds, are not in
    # these literals).
    for inst in data:
        inst["predicted_tokens_s"] = cluster.get("predicted_tokens_s", {}).get(inst["id"], 0.0)
    return data


INSTANCES = instances_of(CLUSTER)


def text_of(renderable: object, width: int = 140) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# ---------------------------------------------------------------- render


def test_render_shows_every_node_with_its_liveness() -> None:
    out = text_of(render(CLUSTER, INSTANCES, now_ms=NOW_MS))
    for name, nid, word in (("studio", A, "alive"), ("tower", B, "suspect"),
                            ("laptop", C, "dead")):  # fmt: skip
        # The node's own row (the header says "nodes alive" whatever the nodes are).
        (row,) = [line for line in out.splitlines() if line.split()[:2] == [name, nid[:8]]]
        assert word in row, row


def test_render_header_names_cluster_alive_count_and_queried_node() -> None:
    first_line = text_of(render(CLUSTER, INSTANCES)).splitlines()[0]
    assert "home" in first_line
    assert "1/3" in first_line
    assert "1 instance " in first_line
    assert "studio" in first_line


def test_render_shows_memory_backends_heartbeat_load_and_runners() -> None:
    out = text_of(render(CLUSTER, INSTANCES, now_ms=NOW_MS))
    assert "12.0/16.0 GiB" in out  # health's mem_available beats the card's
    assert "6.0/16.0 GiB" in out  # no health figure: the card's
    assert "█" in out
    assert "mlx-metal" in out
    assert "llama_cpp-cpu" in out and "mlx-cuda" in out
    assert "RTX 4090 23/24G" in out  # its GPU: free of total
    assert "0.3s" in out and "12s" in out
    assert "1.25" in out
    assert "llama-70b ready" in out
    assert "llama-70b loading" in out
    assert "60m" in out  # uptime from started_ms


def test_render_shows_instance_model_generation_and_stage_ranges_with_state() -> None:
    out = text_of(render(CLUSTER, INSTANCES, now_ms=NOW_MS), width=200)
    assert "12/-" in out  # one request: placement's prediction, nothing measured yet
    assert "meta-llama/Llama-3.1-70B" in out
    assert "studio[0:48) mlx ready" in out
    assert "tower[48:72) llama_cpp loading (node suspect)" in out
    # laptop is dead: the node counts its stage unavailable (whatever runner of an
    # older plan laptop last reported).
    assert "laptop[72:80) llama_cpp unavailable (node dead)" in out


def test_stage_with_no_runner_yet_is_pending_and_unknown_node_is_flagged() -> None:
    cluster = copy.deepcopy(CLUSTER)
    cluster["nodes"][0]["health"]["runners"] = []
    cluster["instances"][0]["stages"].append(
        {"node": "ffffffffffff", "start": 80, "end": 81, "engine": "mlx"}
    )
    out = text_of(render(cluster, instances_of(cluster)))
    assert "studio[0:48) mlx pending" in out
    assert "ffffffff[80:81) mlx unavailable (node unknown)" in out


def test_left_node_and_node_with_null_health_render() -> None:
    cluster = copy.deepcopy(CLUSTER)
    cluster["nodes"][2]["liveness"] = "left"
    cluster["nodes"][2]["health"] = None
    cluster["nodes"][2]["heartbeat_age_s"] = None
    out = text_of(render(cluster, instances_of(cluster), now_ms=NOW_MS))
    assert "laptop" in out and "left" in out
    assert "laptop[72:80) llama_cpp unavailable (node left)" in out


@pytest.mark.parametrize("why", [CRASH_LOOP, MODEL_MISSING, FETCH_FAILED, REFUSED])
def test_a_node_that_gave_up_is_excluded_with_its_reason_in_the_view_and_in_top(
    why: str,
) -> None:
    """Whatever made the node give its runner up, the node's view names it excluded
    (and top shows it), after the repair moved the stage away."""
    cluster = copy.deepcopy(CLUSTER)
    cluster["nodes"][2]["liveness"] = "alive"
    reason = f"{why}: no holder answered" if why == FETCH_FAILED else why
    cluster["nodes"][2]["health"]["runners"] = [
        {"instance": "llama-70b", "generation": 1, "stage": 2, "state": "failed",
         "reason": reason}
    ]  # fmt: skip
    inst = cluster["instances"][0]
    inst["stages"] = inst["stages"][:2]  # the repair moved stage 2 away from laptop
    (view,) = instances_of(cluster)
    assert view["excluded"] == [
        {"node": C, "name": "laptop", "stage": 2, "generation": 1, "reason": reason}
    ]
    out = text_of(render(cluster, [view]), width=200)
    assert f"excluded laptop ({reason})" in out


def test_missing_optional_fields_render() -> None:
    cluster = {
        "self": "n0",
        "nodes": [
            {"id": "n0"},  # no name, liveness, card or health
            {"id": "n1", "name": "bare", "liveness": "alive", "card": {"id": "n1"}},
            {
                "id": "n2",
                "name": "minimal",
                "liveness": "alive",
                "card": {"id": "n2", "name": "minimal", "mem_total": 8 * GIB},
                "health": {"seq": 1},
            },
        ],
    }
    # An instance view with only some of its fields.
    instances = [{"id": "i1", "model": "tiny", "stages": [{"node": "n2", "name": "minimal"}]}]
    out = text_of(render(cluster, instances))
    assert "bare" in out and "minimal" in out and "unknown" in out
    assert "tiny" in out
    assert "minimal[?:?) ?" in out


def test_empty_and_malformed_answers_render() -> None:
    assert "0/0" in text_of(render({}, []))
    assert "no instances placed" in text_of(render({"nodes": []}, []))
    garbage = {"nodes": [None, 3, {"id": "x", "card": "?", "health": [1]}], "instances": "?"}
    bad_views = [None, 3, {"id": "i", "stages": "?", "speed": [1], "excluded": [None, 2]},
                 {"stages": [None, {"node": 5, "state": 7, "ms_per_token": "x"}]}]  # fmt: skip
    out = text_of(render(garbage, bad_views))
    assert "x" in out and "excluded ?" in out
    assert "x" in text_of(render(garbage, "?"))


def test_markup_in_names_is_shown_literally() -> None:
    cluster = copy.deepcopy(CLUSTER)
    cluster["nodes"][0]["name"] = "[bold]studio"
    cluster["nodes"][0]["card"]["name"] = "[bold]studio"
    out = text_of(render(cluster, instances_of(cluster)), width=200)
    assert "[bold]studio" in out
    assert "[bold]studio[0:48) mlx ready" in out


def test_mem_bar_fills_in_proportion() -> None:
    assert mem_bar(8 * GIB, 16 * GIB).plain == "█████░░░░░"
    assert mem_bar(13 * GIB, 16 * GIB).plain == "████████▏░"
    assert mem_bar(0, 16 * GIB).plain == "░" * 10
    assert mem_bar(20 * GIB, 16 * GIB).plain == "█" * 10
    assert mem_bar(None, None).plain == ""


def test_run_top_once_prints_one_frame() -> None:
    class Stub:
        base_url = "http://stub:7470"

        def cluster(self) -> dict:
            return CLUSTER

        def instances(self) -> dict:
            return {"object": "list", "data": INSTANCES}

        def members(self) -> dict:
            return {"data": [], "pending": [{"id": "f00d" * 4, "name": "kitchen",
                                             "waiting_s": 12.0}]}  # fmt: skip

    console = Console(record=True, width=140, file=io.StringIO())
    assert run_top(Stub(), interval=1.0, once=True, console=console) == 0  # type: ignore[arg-type]
    out = console.export_text()
    assert "studio[0:48) mlx ready" in out
    (row,) = [line for line in out.splitlines() if "kitchen" in line]
    assert row.split()[:3] == ["1", "kitchen", "f00d" * 4], row


def test_render_lists_no_waiting_nodes_when_none_wait() -> None:
    assert "waiting to join" not in text_of(render(CLUSTER, INSTANCES, NOW_MS, pending=[]))
    out = text_of(render(CLUSTER, INSTANCES, NOW_MS, pending=[{"name": "[b]x[/b]", "id": "1"}]))
    assert "waiting to join" in out and "[b]x[/b]" in out  # names shown literally


class FlakyNode:
    """Answers, goes away, comes back, then the user presses Ctrl-C."""

    base_url = "http://flaky:7470"

    def __init__(self) -> None:
        self.calls = 0

    def cluster(self) -> dict:
        self.calls += 1
        if self.calls == 2:
            raise NodeUnreachable(self.base_url, "[Errno 111] Connection refused")
        if self.calls == 3:
            raise NodeError(
                self.base_url, "/v1/cluster", "HTTP 500: boom", status=500, method="GET"
            )
        if self.calls >= 5:
            raise KeyboardInterrupt
        return CLUSTER

    def instances(self) -> dict:
        return {"object": "list", "data": INSTANCES}

    def members(self) -> dict:
        # An open cluster's node says it has no members to list.
        raise NodeError(
            self.base_url, "/v1/members", "HTTP 409: open cluster", status=409, method="GET"
        )


@pytest.mark.parametrize("terminal", [True, False], ids=["live", "piped"])
def test_run_top_shows_an_error_panel_and_recovers_and_ctrl_c_exits_0(terminal: bool) -> None:
    node = FlakyNode()
    console = Console(record=True, width=140, file=io.StringIO(), force_terminal=terminal)
    assert run_top(node, interval=0.01, console=console) == 0  # type: ignore[arg-type]
    out = console.export_text()
    assert node.calls == 5
    assert "cannot reach meshd node at http://flaky:7470" in out
    assert "HTTP 500: boom" in out
    assert "last update" in out
    assert out.count("studio[0:48) mlx ready") >= 2  # before and after the outage
    assert "Traceback" not in out


# ---------------------------------------------------------------- --node


@pytest.mark.parametrize(
    ("spec", "url"),
    [
        ("10.0.0.5:8000", "http://10.0.0.5:8000"),
        (":9000", "http://127.0.0.1:9000"),
        ("mini.local", "http://mini.local:7470"),
        ("http://mini.local:7470", "http://mini.local:7470"),
        ("https://gw.example/meshd/", "https://gw.example/meshd"),
        ("[::1]:7000", "http://[::1]:7000"),
        ("[::1]", "http://[::1]:7470"),
        ("fe80::1", "http://[fe80::1]:7470"),
        ("  host:1  ", "http://host:1"),
    ],
)
def test_parse_node_forms(spec: str, url: str) -> None:
    assert parse_node(spec, env={}) == url


def test_parse_node_default_and_env_override() -> None:
    assert parse_node(None, env={}) == "http://127.0.0.1:7470"
    assert parse_node("", env={}) == "http://127.0.0.1:7470"
    assert parse_node(None, env={"MESHCTL_NODE": "mini:7999"}) == "http://mini:7999"
    assert parse_node(None, env={"MESHCTL_NODE": ""}) == "http://127.0.0.1:7470"
    # an explicit --node beats the environment
    assert parse_node("tower", env={"MESHCTL_NODE": "mini:7999"}) == "http://tower:7470"


@pytest.mark.parametrize("spec", ["host:0", "host:99999", "host:x", "ftp://h", "http://", "[::1"])
def test_parse_node_rejects_bad_values(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_node(spec, env={})


# ---------------------------------------------------------------- failing and real HTTP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_raises_node_unreachable_with_a_clear_message() -> None:
    port = _free_port()
    client = NodeClient(f"http://127.0.0.1:{port}", timeout=2)
    with client, pytest.raises(NodeUnreachable) as err:
        client.cluster()
    msg = str(err.value)
    assert msg.startswith(f"cannot reach meshd node at http://127.0.0.1:{port}: ")
    assert "is `meshd up` running?" in msg


@pytest.mark.parametrize("argv", [["top", "--once"], ["nodes"], ["nodes", "--json"]])
def test_meshctl_exits_2_without_traceback_when_node_is_unreachable(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    port = _free_port()
    assert main(["--node", f"127.0.0.1:{port}", *argv]) == 2
    err = capsys.readouterr().err
    assert "cannot reach meshd node" in err
    assert "Traceback" not in err


def test_meshctl_bad_node_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nodes", "--node", "host:99999"]) == 2
    assert "bad port" in capsys.readouterr().err


@pytest.fixture
def fake_node() -> Iterator[str]:
    """A stdlib HTTP server answering /v1/cluster with CLUSTER and /v1/instances with
    INSTANCES (a stand-in for a node)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/v1/cluster":
                body, code = json.dumps(CLUSTER).encode(), 200
            elif self.path == "/v1/instances":
                body, code = json.dumps({"object": "list", "data": INSTANCES}).encode(), 200
            else:
                body, code = b'{"detail": "not found"}', 404
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_meshctl_top_once_and_nodes_over_http(
    fake_node: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wide terminal, whatever runs the test (an xdist worker's output is no terminal:
    # 80 columns, where `nodes` leaves out the platform column first).
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["top", "--once", "--node", fake_node]) == 0
    out = capsys.readouterr().out
    assert "studio[0:48) mlx ready" in out and "laptop" in out

    assert main(["--node", fake_node, "nodes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == CLUSTER["nodes"]

    assert main(["--node", fake_node, "nodes"]) == 0
    out = capsys.readouterr().out
    assert "darwin/arm64" in out and "tower" in out


def test_http_error_from_the_node_is_a_node_error(fake_node: str) -> None:
    with NodeClient(f"http://{fake_node}") as client, pytest.raises(NodeError, match="HTTP 404"):
        client.healthz()


def _facts(arch: str, **over: object) -> dict:
    facts = {
        "name": arch,
        "sha256": "",
        "architecture": arch,
        "n_layers": 4,
        "hidden_size": 64,
        "n_ctx_train": 512,
        "layer_bytes": [100] * 4,
        "engines": ["llama_cpp"],
        **over,
    }
    return facts  # fmt: skip


def test_the_instance_view_says_its_sizes_why_it_runs_whole_and_what_it_runs_without() -> None:
    cluster = copy.deepcopy(CLUSTER)
    stage = [{"node": A, "start": 0, "end": 4, "engine": "llama_cpp"}]
    moe = _facts("qwen3moe", layer_active_bytes=[40] * 4, embed_bytes=10, head_bytes=5)
    cluster["instances"] = [
        {"id": "moe", "spec": {"model": "moe"}, "stages": stage, "facts": moe},
        {"id": "gpt2", "spec": {"model": "gpt2"}, "stages": stage, "facts": _facts("gpt2")},
        {"id": "lfm2", "spec": {"model": "lfm2"}, "stages": stage, "facts": _facts("lfm2")},
        {"id": "bare", "spec": {"model": "bare"}, "stages": stage},
        {"id": "smol", "spec": {"model": "smol"}, "stages": stage,
         "facts": _facts("smollm3", n_layers=12, layer_bytes=[100] * 12)},
    ]  # fmt: skip
    got = {i["id"]: i for i in instances_of(cluster)}
    assert (got["moe"]["weight_bytes"], got["moe"]["active_bytes"]) == (415, 175)
    assert got["moe"]["split_refusal"] is None and got["moe"]["state_refusals"] == {}
    assert "position embeddings" in got["gpt2"]["split_refusal"]
    # smollm3 may be cut, every 4 layers only: the view says so (and why).
    assert got["smol"]["split_refusal"] is None and got["moe"]["cut_rule"] is None
    assert got["smol"]["cut_rule"].startswith("is cut only every 4 layers (llama.cpp skips rope")
    assert got["smol"]["cut_rule"].endswith("12 layers make at most 3 stage(s)")
    assert set(got["lfm2"]["state_refusals"]) == {"speculation", "prefix_cache", "n_sharing"}
    assert all("recurrent" in why for why in got["lfm2"]["state_refusals"].values())
    bare = got["bare"]  # an instance without facts: nothing known, nothing refused
    assert (bare["weight_bytes"], bare["active_bytes"], bare["split_refusal"]) == (None,) * 3

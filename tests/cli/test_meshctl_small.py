"""The small things a newcomer meets first: every meshctl error names the request that
failed (its method and path), ``--version``, both CLIs piped into ``head``, and the
progress of a stage's fetch in ``meshctl place --wait``."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from meshd import __version__
from meshd.cli.client import NodeClient, NodeError
from meshd.cli.instances import stage_progress


class _Odd(http.server.BaseHTTPRequestHandler):
    """A node that answers POST with HTML, DELETE with a 404 and streams an error."""

    def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/chat/completions":
            event = b'data: {"error": {"message": "stage lost"}}\n\n'
            self._answer(200, event, "text/event-stream")
        else:
            self._answer(200, b"<html>a proxy</html>", "text/html")

    def do_DELETE(self) -> None:
        self._answer(404, b'{"error": {"message": "no instance abc"}}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def odd_node() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Odd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_each_error_names_its_method_and_path(odd_node: str) -> None:
    with NodeClient(odd_node) as client:
        with pytest.raises(NodeError, match=r": POST /v1/instances: answer is not JSON"):
            client.place({"model": "m"})
        with pytest.raises(NodeError, match=r": DELETE /v1/instances/abc: HTTP 404: no instance"):
            client.remove("abc")
        with pytest.raises(NodeError, match=r": POST /v1/chat/completions: stage lost"):
            list(client.chat_stream({"model": "m", "messages": []}))


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def test_meshctl_says_its_version() -> None:
    r = _run(sys.executable, "-m", "meshd.cli.meshctl", "--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"meshctl {__version__}")


@pytest.mark.parametrize(
    "cli", [["meshd.cli.meshd", "config", "show"], ["meshd.cli.meshctl", "--help"]]
)
def test_a_reader_that_leaves_early_is_no_error(cli: list[str]) -> None:
    # `true` leaves before the CLI writes (as `head` leaves after its lines): every
    # write meets a closed pipe.
    line = " ".join([sys.executable, "-m", *cli]) + " | true"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", line], capture_output=True, text=True,
                       timeout=30)  # fmt: skip
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_a_stage_progress_shows_its_fetch_then_stays_full() -> None:
    # As `meshctl place --wait` polls one stage: pending, fetching, loading, ready.
    seen = 0
    shown = []
    for view in [
        {"state": "pending", "fetched": 0, "fetch_total": 0},
        {"state": "fetching", "fetched": 0, "fetch_total": 0},  # the size not known yet
        {"state": "fetching", "fetched": 31_200_000, "fetch_total": 65_100_000},
        {"state": "loading", "fetched": 0, "fetch_total": 0},  # the node sends 0s now
        {"state": "ready", "fetched": 0, "fetch_total": 0},
    ]:
        total, done, text = stage_progress(view, seen)
        seen = total or 0
        shown.append((total, done, text))
    assert shown == [
        (None, 0, ""), (None, 0, ""),
        (65_100_000, 31_200_000, "31.2/65.1 MB"),
        (65_100_000, 65_100_000, "65.1 MB fetched"),
        (65_100_000, 65_100_000, "65.1 MB fetched"),
    ]  # fmt: skip
    # A stage that fetches nothing never shows a size ("0/? bytes" before).
    assert stage_progress({"state": "loading"}, 0) == (None, 0, "")

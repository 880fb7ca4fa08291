"""The web page (``/ui``) in a real headless Chromium, against a 2-node split.

One cluster for the module: nodes a and b serve one model split over both (the default
model's weights under a template that thinks, from a folder both hold, so no slice
travels); b keeps its API behind a key. The browser is Debian's ``chromium`` driven by
Playwright (never ``playwright install``): ``$MESHD_CHROMIUM``, else the first of
``chromium``, ``chromium-browser``, ``google-chrome`` on PATH; the module is skipped,
saying why, without one. Every wait is on an event of the page, bounded.

Screenshots at 390 px (a phone) and 1280 px wide are saved under the test's tmp dir,
and under ``$MESHD_UI_SHOTS`` when it is set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshd.api.webui import CSP
from meshd.engines.runner.thinking import SCRIPT_ENV
from tests.cluster import ADMIN_KEY, Cluster, NodeProc, wait_for, wait_serving
from tests.synthetic import with_chat_template

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
expect = sync_api.expect

pytestmark = pytest.mark.timeout(150)

#: Bounds of the page's waits (ms): the feed sends a snapshot at least every 2 s.
SOON = 20_000

KEY = "sk-test-ui-page"
#: A chat turn starting with this gets the rest as the model's output (the runners'
#: test drill, meshd.engines.runner.thinking).
SCRIPT = "@@ui-script@@"
#: Qwen3's shape (as tests/api/test_reasoning.py writes it): the node reads from the
#: template that the model thinks in <think> tags, and splits the thoughts out.
THINKER = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' and m.reasoning_content %}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)
THOUGHTS = "They greet me; I greet them back."
ANSWER = "Hello from the mesh!"
#: Names a stranger picks: a waiting node's and the model file's. Run as markup, either
#: would set window.__pwned.
HOSTILE_NODE = '<img src=x onerror="window.__pwned=1">'
HOSTILE_MODEL = 'thinker <img src=x onerror="window.__pwned=2">.gguf'


def _chromium() -> str:
    for candidate in (os.environ.get("MESHD_CHROMIUM"), "chromium", "chromium-browser",
                      "google-chrome"):  # fmt: skip
        found = candidate and shutil.which(candidate)
        if found:
            return found
    pytest.skip("no chromium to drive (./install.sh --test installs Debian's; or $MESHD_CHROMIUM)")


@dataclass
class Split:
    cluster: Cluster
    a: NodeProc
    b: NodeProc
    instance: str
    model: str

    @property
    def b_url(self) -> str:
        # A keyed API listens on every interface; the browser dials loopback.
        return self.b.api.replace("0.0.0.0", "127.0.0.1")


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[Split]:
    tmp = tmp_path_factory.mktemp("ui")
    models = tmp / "models"
    models.mkdir()
    with_chat_template(model_path, models / HOSTILE_MODEL, THINKER)
    with Cluster(tmp) as c:
        env = {SCRIPT_ENV: SCRIPT}
        a = c.start("a", env=env, extra_args=["--models", str(models)], timeout=60)
        b = c.start("b", peers=[a], env={**env, "MESHD_API_KEY": KEY},
                    extra_args=["--models", str(models)])  # fmt: skip
        wait_for(lambda: a.liveness() == {"a": "alive", "b": "alive"}, 30)
        # Placed by the name the nodes advertise it under, as `meshctl place` would.
        card = next(n["card"] for n in a.cluster()["nodes"] if n["name"] == "a")
        (name,) = [m for m in card["models"] if "thinker" in m]
        assert HOSTILE_MODEL.removesuffix(".gguf") in name, name
        r = httpx.post(a.api + "/v1/instances", json={"model": name, "nodes": ["a", "b"]},
                       timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text
        iid = r.json()["id"]
        wait_serving(a, iid, 90)
        yield Split(c, a, b, iid, name)


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Where screenshots go: the test's tmp dir, and $MESHD_UI_SHOTS if set."""
    dirs = [tmp_path_factory.mktemp("shots")]
    if os.environ.get("MESHD_UI_SHOTS"):
        dirs.append(Path(os.environ["MESHD_UI_SHOTS"]))
        dirs[-1].mkdir(parents=True, exist_ok=True)
    return dirs


@pytest.fixture(scope="module")
def browser(split: Split) -> Iterator[Any]:
    """Headless Chromium, started after the cluster: Playwright's sync API holds an
    event loop in this thread, in which the nodes' start (asyncio.run) could not run."""
    exe = _chromium()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, timeout=30_000)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def page(split: Split, browser: Any) -> Iterator[Any]:
    """Node a's page, wide; every script error or policy violation is a failure."""
    pg = browser.new_page(viewport={"width": 1280, "height": 900})
    pg.set_default_timeout(SOON)
    expect.set_options(timeout=SOON)  # expect() has its own default (5 s)
    errors: list[str] = []

    def console(m: Any) -> None:
        # The browser logs every answer that is no 2xx (the approval refused without
        # the admin key, which the test asks for): the page shows those itself.
        if m.type == "error" and "Failed to load resource" not in m.text:
            errors.append(f"console {m.type}: {m.text}")

    pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    pg.on("console", console)
    yield pg
    pg.close()
    assert not errors, errors


def _shoot(page: Any, shots: list[Path], name: str) -> None:
    for width in (390, 1280):
        page.set_viewport_size({"width": width, "height": 844 if width == 390 else 900})
        data = page.screenshot(full_page=True)
        for d in shots:
            (d / f"{name}-{width}.png").write_bytes(data)
    page.set_viewport_size({"width": 1280, "height": 900})


def _pwned(page: Any) -> Any:
    return page.evaluate("window.__pwned")


def test_the_page_shows_both_nodes_and_the_split_instance(page: Any, split: Split) -> None:
    resp = page.goto(split.a.api + "/ui")
    assert resp is not None and resp.status == 200
    headers = resp.headers
    assert headers["content-security-policy"] == CSP
    assert "frame-ancestors 'none'" in CSP and "script-src 'self'" in CSP
    assert headers["x-content-type-options"] == "nosniff"
    nodes = page.locator("#nodes .node")
    expect(nodes).to_have_count(2)
    expect(nodes.locator(".name")).to_have_text(["a", "b"])
    expect(nodes.locator(".badge.live-alive")).to_have_count(2)
    expect(page.locator("#summary")).to_contain_text("2/2 nodes alive")
    inst = page.locator(f'#instances .instance[data-id="{split.instance}"]')
    expect(inst.locator(".model")).to_have_text(split.model)
    expect(inst.locator(".stage .where")).to_have_text([re.compile(r"^a \[0:"),
                                                        re.compile(r"^b \[")])  # fmt: skip
    expect(inst.locator(".stage .badge")).to_have_text(["ready", "ready"])
    held = page.locator(f"#models tbody tr[data-model={json.dumps(split.model)}]")
    expect(held.locator(".holders")).to_have_text("a, b")
    expect(held.locator(".serving")).to_contain_text(f"{split.instance} ready")
    assert _pwned(page) is None


def test_tokens_per_second_move_while_a_stream_runs(page: Any, split: Split) -> None:
    tps = page.locator(f'#instances .instance[data-id="{split.instance}"] .tps .v')
    expect(tps).to_have_text("0.0")  # nothing ran yet
    body = {"model": split.model, "stream": True, "max_tokens": 32, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about the sea."}]}  # fmt: skip
    status: list[int] = []

    def stream() -> None:
        with httpx.stream("POST", split.a.api + "/v1/chat/completions", json=body,
                          timeout=60) as r:  # fmt: skip
            status.append(r.status_code)
            for _ in r.iter_lines():
                pass

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    try:
        expect(tps).not_to_have_text("0.0", timeout=40_000)
        assert float(tps.inner_text()) > 0
        # Node a's API streamed it: its own figure moves too.
        mine = page.locator(f'#nodes .node[data-id="{split.a.node_id}"] .tps .v')
        expect(mine).not_to_have_text("0.0")
    finally:
        t.join(60)
    assert status == [200]


def test_a_chat_streams_its_answer_with_the_thoughts_apart(page: Any, split: Split) -> None:
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.post_data or "")
            if r.url.endswith("/v1/chat/completions") else None)  # fmt: skip
    expect(page.locator("#chat-model")).to_have_value(split.model)
    page.fill("#chat-input", f"{SCRIPT}<think>\n{THOUGHTS}\n</think>\n\n{ANSWER}<|im_end|>")
    page.click("#chat-send")
    reply = page.locator("#chat-log .msg.assistant").last
    expect(reply.locator(".answer")).to_have_text(ANSWER)
    expect(reply.locator(".reasoning")).to_be_visible()
    expect(reply.locator(".reasoning-text")).to_contain_text(THOUGHTS)
    expect(page.locator("#chat-send")).to_be_enabled()
    assert sent and '"stream":true' in sent[-1]


def test_a_waiting_node_is_let_in_with_the_admin_key_only_and_its_name_is_text(
    page: Any, split: Split, shots: list[Path]
) -> None:
    c = split.cluster.start(HOSTILE_NODE, peers=[split.a], secret=False, wait=False,
                            data_dir=split.cluster.tmp / "joiner")  # fmt: skip
    wait_for(lambda: "waiting for a member to approve" in c.log(), 30)
    said = re.search(r"meshctl approve ([0-9A-Z]{4}-[0-9A-Z]{4}).*this node: .*, id ([0-9a-f]{16})",
                     c.log())  # fmt: skip
    assert said, c.log()[-2000:]
    code, joiner = said[1], said[2]
    row = page.locator(f'#pending .joiner[data-id="{joiner}"]')
    # The name shows as the characters it is: no element made of it, no script run.
    expect(row.locator(".name")).to_have_text(HOSTILE_NODE)
    expect(row.locator(".fingerprint code")).to_have_text(joiner)
    assert page.locator("img").count() == 0 and _pwned(page) is None
    _shoot(page, shots, "waiting")

    row.locator("input.code").fill(code)
    row.locator("button.approve").click()
    expect(row.locator(".result")).to_contain_text("Refused: 401")
    expect(row.locator(".result")).to_contain_text("admin key")
    assert httpx.get(split.a.api + "/v1/members", timeout=30).json()["pending"], "let in"

    page.click("#keys-toggle")
    page.fill("#admin-key", ADMIN_KEY)
    page.click("#keys-form button[type=submit]")
    row.locator("button.approve").click()
    expect(row.locator(".result")).to_contain_text("Approved")
    joined = page.locator(f'#nodes .node[data-id="{joiner}"]')
    expect(joined.locator(".name")).to_have_text(HOSTILE_NODE, timeout=30_000)
    expect(page.locator("#pending .joiner")).to_have_count(0)
    assert page.locator("img").count() == 0 and _pwned(page) is None
    # The key lives in this tab's sessionStorage, never in a cookie.
    assert page.evaluate("sessionStorage.getItem('meshd.adminKey')") == ADMIN_KEY
    assert page.evaluate("document.cookie") == ""
    _shoot(page, shots, "cluster")


def test_a_keyed_node_serves_the_page_and_asks_for_its_key(browser: Any, split: Split) -> None:
    url = split.b_url
    assert httpx.get(url + "/ui", timeout=30).status_code == 200
    assert httpx.get(url + "/v1/cluster/stream", timeout=30).status_code == 401
    assert httpx.get(url + "/ui/nothing.js", timeout=30).status_code == 404
    # No path from a request reaches the disk: a name with a slash is no file of the page.
    assert httpx.get(split.a.api + "/ui/..%2Fapp.py", timeout=30).status_code == 404
    pg = browser.new_page(viewport={"width": 390, "height": 844})
    pg.set_default_timeout(SOON)
    try:
        pg.goto(url + "/ui")
        expect(pg.locator("#link")).to_have_text("needs a key")
        expect(pg.locator("#notice")).to_contain_text("needs an API key")
        expect(pg.locator("#api-key")).to_be_focused()
        pg.fill("#api-key", KEY)
        pg.press("#api-key", "Enter")
        expect(pg.locator("#link")).to_have_text("live")
        expect(pg.locator(f'#nodes .node[data-id="{split.a.node_id}"] .name')).to_have_text("a")
        expect(pg.locator("#notice")).to_be_hidden()
    finally:
        pg.close()

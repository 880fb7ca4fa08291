#!/usr/bin/env python
"""What a SIGKILL costs a stream: detection, end-or-resume and repair times, on real nodes.

Three ``meshd up`` processes on loopback (``tests.cluster``) serve the default model
as a 3-stage pipeline [a, b, c]. Each trial places it afresh, streams a greedy
completion from a, SIGKILLs the middle node b mid-stream, and measures from the kill
(``tests.faultlab``, the code the fault tests use):

(a) until a sees b as suspect, and as dead;
(b) until the stream resumed (first token after the gap, replayed on the repaired
    plan) or ended with a typed error;
(c) until the repaired instance (generation + 1, every stage ready) serves again.

b is restarted under the same id before the next trial. Then ``--runner-trials`` trials kill
only b's stage-1 runner subprocess (b stays up): (a) is then when the stage stops
being ready, (c) when the restarted runner is ready again.

Run: ``python bench/faults.py [--trials 20] [--runner-trials 5] [--tokens 200]``.
Not a test: it prints the figures (median and max) and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from tests import faultlab
from tests.cluster import Cluster, act_as_owner


def main(argv: list[str] | None = None) -> int:
    """Run the trials and print the summaries."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="node SIGKILL trials (20)")
    ap.add_argument("--runner-trials", type=int, default=5, help="runner-only SIGKILLs (5)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream (200)")
    args = ap.parse_args(argv)
    act_as_owner()  # faultlab places and removes models: as the nodes' owner
    with tempfile.TemporaryDirectory(prefix="meshd-faults-") as tmp, Cluster(Path(tmp)) as cl:
        nodes, reference = faultlab.three_nodes_and_reference(cl, args.tokens)
        t0 = time.monotonic()
        trials = []
        for i in range(args.trials):
            trials.append(faultlab.kill_middle(cl, nodes, reference, args.tokens))
            print(f"  node trial {i + 1}/{args.trials}: {trials[-1]}", file=sys.stderr)
        print(f"SIGKILL of the middle node of a 3-stage pipeline ({args.tokens}-token streams)")
        print(faultlab.summary(trials))
        runner = []
        for i in range(args.runner_trials):
            runner.append(faultlab.kill_runner(cl, nodes, reference, args.tokens))
            print(f"  runner trial {i + 1}/{args.runner_trials}: {runner[-1]}", file=sys.stderr)
        if runner:
            print("\nSIGKILL of the middle stage's runner only (its node stays up)")
            print(faultlab.summary(runner).replace("death detected", "stage not ready"))
        print(f"\n({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

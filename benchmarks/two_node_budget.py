"""The time budget of a two-node job: how long ``tune()`` takes on every rank of a job of
2 nodes x 2 ranks, against its ``time_budget``, with and without faults.

Each scenario is ``tests/torchrun_job.py``'s (a DDP step over gloo, 2 ms reads, batches
of 16), launched on two nodes by ``tests/nodes.py`` (each node's torchrun agent in a
UTS namespace of its own, ``node-a`` and ``node-b``, sharing this machine):

- ``plain``: nothing fails;
- ``faults-on-last-rank``: on rank 3 (node-b), a third worker fills 1 GiB (over node-b's
  budget of 1 GiB) and a fourth segfaults;
- ``hang-on-last-rank``: on rank 3, workers from index 2 up never return.

The figures: ``tune()``'s seconds on each rank, from the call to its return (joining
the ranks included), the job's from launching the agents to their exit (Python, torch
and the rendezvous included), and the chosen setting. Needs root (``unshare``).

    python benchmarks/two_node_budget.py [--budget 60] [--scenarios plain ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import nodes  # noqa: E402

SCENARIOS = ("plain", "faults-on-last-rank", "hang-on-last-rank")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    args = parser.parse_args()
    reason = nodes.unavailable()
    if reason is not None:
        sys.exit(f"two nodes cannot be started here: {reason}")
    # Over the environment (nodes.start adds it beneath): this checkout, one thread.
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    print(f"| scenario | tune() s per rank (budget {args.budget:.0f}) | over budget | "
          "job s (agents' launch to exit) | chosen | failed trials |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for scenario in args.scenarios:
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch)
            started = time.perf_counter()
            job = nodes.start(
                ["-m", "tests.torchrun_job", str(out), scenario, str(args.budget)],
                cwd=out, env=env,
            )  # fmt: skip
            if not job.wait(args.budget * 3) or any(job.returncodes):
                sys.exit(f"{scenario}: the job failed:\n{job.output()[-4000:]}")
            wall = time.perf_counter() - started
            reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
        seconds = [r["seconds"] for r in reports]
        result = reports[0]["result"]
        failed = sorted({t["kind"] for t in result["trials"] if t["state"] != "complete"})
        params = result["params"]
        chosen = f"{params['num_workers']} workers" + (
            ", persistent" if params.get("persistent_workers") else ""
        )
        print(f"| {scenario} | {', '.join(f'{s:.1f}' for s in seconds)} | "
              f"{max(seconds) / args.budget - 1:+.1%} | {wall:.1f} | {chosen} | "
              f"{', '.join(failed) or 'none'} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

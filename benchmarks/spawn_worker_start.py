"""A spawned worker's start-up with autoloader's worker code, this checkout against
another revision, side by side.

A DataLoader whose ``worker_init_fn`` is autoloader's (``LimitThreads``: a tuned
``worker_threads``) under spawn, as on Windows and macOS: each worker imports torch,
unpickles that function, and imports the part of autoloader it lives in. Each round
starts the loader in a fresh process, once per code tree, interleaved (A B A B ...), and
records the time to the first batch and the CPU the workers used (their start-up
mostly: a batch of a TensorDataset is cheap).

    python benchmarks/spawn_worker_start.py --before 6e40e6b [--rounds 5] [--workers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.revisions import CHECKOUT, checkout

_CHILD = """
import json, resource, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
from autoloader.loader._worker_threads import LimitThreads

if __name__ == "__main__":
    workers = int(sys.argv[1])
    dataset = TensorDataset(torch.arange(4096.0))
    began = time.perf_counter()
    loader = DataLoader(dataset, batch_size=64, num_workers=workers,
                        multiprocessing_context="spawn", worker_init_fn=LimitThreads(1))
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - began
    del batches, loader
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"first": first, "cpu": (used.ru_utime + used.ru_stime) / workers}))
"""


def _start(code: Path, workers: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    ran = subprocess.run(
        [sys.executable, "-c", _CHILD, str(workers)],
        cwd=code, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(json.loads(ran.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    trees = {args.before: checkout(args.before), "this checkout": CHECKOUT}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, code in trees.items():
            runs[name].append(_start(code, args.workers))
    print(f"{args.workers} spawned workers, {args.rounds} rounds, medians:")
    for name, rounds in runs.items():
        first = statistics.median(r["first"] for r in rounds)
        cpu = statistics.median(r["cpu"] for r in rounds)
        print(f"  {name:>14}: first batch {first:.2f} s, CPU a worker {cpu:.2f} s")


if __name__ == "__main__":
    main()

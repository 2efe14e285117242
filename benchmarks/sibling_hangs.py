"""Hangs told from the trial's own workers: how long each hung trial waits, and what is
chosen, where worker processes from index 3 up never return.

Three workers work; each read waits ``--latency`` seconds (a latency-bound dataset),
batches of 16, a 5 ms step, worker processes only (thread workers have no worker index
to hang by). ``tune()`` with a ``--time-budget`` budget, once per latency; it prints
each failed trial's worker count and the wait its reason names, the choice and the
tuning time. ``--code DIR`` imports ``autoloader`` from another checkout (``git worktree
add DIR REV``), to put the code before a change beside it.

    python benchmarks/sibling_hangs.py [--latency 0.002 0.01] [--time-budget 45]
        [--code /tmp/before]
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch
from torch.utils.data import Dataset, get_worker_info


class HangsFromWorker3(Dataset[torch.Tensor]):
    def __init__(self, latency: float, length: int = 20_000) -> None:
        self.latency, self.length = latency, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None and info.id >= 3:
            time.sleep(3600)
        time.sleep(self.latency)
        return torch.zeros(16)


def step(batch: torch.Tensor) -> None:
    time.sleep(0.005)


_WAIT = re.compile(r"(\d+(?:\.\d+)?) s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, nargs="+", default=[0.002, 0.01])
    parser.add_argument("--time-budget", type=float, default=45.0)
    parser.add_argument("--code", default=None)
    args = parser.parse_args()
    if args.code:
        sys.path.insert(0, args.code)
    import autoloader

    print(f"autoloader from {autoloader.__file__}")
    print("| read latency | hung trials (workers: wait) | chosen | tuning s |")
    print("|---|---|---|---|")
    for latency in args.latency:
        started = time.perf_counter()
        result = autoloader.tune(
            HangsFromWorker3(latency),
            step,
            batch_size=16,
            time_budget=args.time_budget,
            search_space={"worker_kind": "processes"},
            show_progress=False,
        )
        seconds = time.perf_counter() - started
        hung = [
            f"{t.params['num_workers']}: {_WAIT.search(t.reason or '')[1]} s"  # type: ignore[index]
            for t in result.trials
            if t.state == "failed" and _WAIT.search(t.reason or "")
        ]
        chosen = result.params["num_workers"]
        print(
            f"| {latency * 1000:.0f} ms | {', '.join(hung)} | {chosen} workers | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

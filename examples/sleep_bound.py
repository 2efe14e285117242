"""Tune a latency-bound pipeline whose best throughput is known in advance.

Each item waits 5 ms (a read from remote storage), batches hold 8 items, and the
training step takes 10 ms of accelerator time (a sleep, leaving the CPU free). Loading a
batch takes 40 ms in one process; the step caps the loop at 8 / 0.010 = 800 samples/s.

    python examples/sleep_bound.py [--time-budget 60] [--out sleep_bound.json]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from torch.utils.data import Dataset

import autoloader

ITEM_LATENCY = 0.005
STEP_TIME = 0.010
BATCH_SIZE = 8


class SleepDataset(Dataset[torch.Tensor]):
    def __init__(self, length: int = 100_000) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(ITEM_LATENCY)
        return torch.full((16,), float(index))


def step(batch: torch.Tensor) -> None:
    time.sleep(STEP_TIME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=60.0)
    parser.add_argument("--out", default="sleep_bound.json")
    parser.add_argument("--isolation", choices=("in-process", "subprocess"), default="in-process")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every trial")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s"
    )

    started = time.perf_counter()
    result = autoloader.tune(
        SleepDataset(),
        step,
        batch_size=BATCH_SIZE,
        time_budget=args.time_budget,
        isolation=args.isolation,
    )
    elapsed = time.perf_counter() - started
    ceiling = BATCH_SIZE / STEP_TIME
    states = [t.state for t in result.trials]
    # The ceiling bounds the steady rate; the epoch rate also pays the workers' start-up.
    tuned = result.steady_throughput or result.throughput
    baseline = result.steady_baseline or result.baseline
    pruned, failed = states.count("pruned"), states.count("failed")
    print(f"best settings:      {result.params}")
    print(f"tuned, steady:      {tuned:.0f} samples/s = {tuned / ceiling:.2f} of {ceiling:.0f}")
    print(
        f"baseline (0 work.): {baseline:.0f} samples/s = {baseline / ceiling:.2f} of {ceiling:.0f}"
    )
    print(
        f"over an epoch:      {result.throughput:.0f} samples/s, start-up included: "
        f"{result.speedup:.2f}x the baseline"
    )
    print(f"tuning time:        {elapsed:.1f} s (budget {args.time_budget:.0f} s)")
    print(f"trials:             {len(states)} run, {pruned} pruned, {failed} failed")
    result.save(args.out)
    print(f"saved:              {args.out}")


if __name__ == "__main__":
    main()

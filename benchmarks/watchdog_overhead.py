"""The memory watchdog's cost on the loop it watches, measured side by side.

Runs the sleep-bound loop (5 ms per item, batch 8, 10 ms step) with 12 workers, with and
without a MemoryWatch sampling the process tree, interleaved (A B A B ...), and prints
the medians and their ratio.

    python benchmarks/watchdog_overhead.py [--rounds 5] [--workers 12]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

from autoloader.measure._memory import MemoryWatch


class Sleep(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10**7

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.005)
        return torch.zeros(16)


def rate(workers: int, batches: int, watched: bool) -> float:
    loader = DataLoader(Sleep(), batch_size=8, num_workers=workers, persistent_workers=True)
    iterator = iter(loader)
    for _ in range(4 * workers):
        next(iterator)
        time.sleep(0.01)
    watch = MemoryWatch(1 << 50).start() if watched else None
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator)
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    if watch is not None:
        watch.stop()
    del iterator, loader
    return 8 * batches / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    plain: list[float] = []
    watched: list[float] = []
    for _ in range(args.rounds):
        plain.append(rate(args.workers, args.batches, watched=False))
        watched.append(rate(args.workers, args.batches, watched=True))
    p, w = statistics.median(plain), statistics.median(watched)
    print(f"{args.workers} workers, {args.rounds} interleaved rounds of {args.batches} batches")
    print(f"without watchdog: {p:.0f} samples/s (min-max {min(plain):.0f}-{max(plain):.0f})")
    print(f"with watchdog:    {w:.0f} samples/s (min-max {min(watched):.0f}-{max(watched):.0f})")
    print(f"ratio:            {w / p:.3f} (cost {100 * (1 - w / p):.1f}%)")


if __name__ == "__main__":
    main()

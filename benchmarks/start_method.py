"""Worker start-up time and memory under each start method, measured side by side.

Why autoloader does not search the start method: for each of fork, forkserver and
spawn, a DataLoader over an in-memory dataset of Python objects (a list of 200,000
dicts, the copy-on-read case) is started with 4 workers, interleaved (A B C A B C ...).
It prints the time to the first batch (worker start-up plus one load), the steady
rate, and the peak PSS of the process tree, which counts pages shared between
processes once.

    python benchmarks/start_method.py [--rounds 3] [--workers 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

from autoloader.measure._memory import MemoryWatch
from autoloader.measure._units import format_bytes


class Records(Dataset[torch.Tensor]):
    """Python objects held in memory: every read touches their reference counts."""

    def __init__(self, length: int = 200_000) -> None:
        self.records = [{"id": i, "values": [float(i)] * 8} for i in range(length)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(self.records[index]["values"])


def measure(dataset: Records, method: str, workers: int, batches: int) -> tuple[float, float, int]:
    watch = MemoryWatch(1 << 50).start()
    started = time.perf_counter()
    loader = DataLoader(
        dataset,
        batch_size=64,
        shuffle=True,
        num_workers=workers,
        multiprocessing_context=multiprocessing.get_context(method),
    )
    iterator = iter(loader)
    next(iterator)
    first = time.perf_counter() - started
    steady_start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    rate = 64 * batches / (time.perf_counter() - steady_start)
    watch.stop()
    del iterator, loader
    return first, rate, watch.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    dataset = Records()
    methods = ("fork", "forkserver", "spawn")
    runs: dict[str, list[tuple[float, float, int]]] = {m: [] for m in methods}
    for _ in range(args.rounds):
        for method in methods:
            runs[method].append(measure(dataset, method, args.workers, args.batches))
    print(f"{args.workers} workers, {len(dataset):,} records, {args.rounds} interleaved rounds")
    print(f"{'start method':12} {'first batch s':>14} {'samples/s':>10} {'peak PSS':>10}")
    for method, results in runs.items():
        first = statistics.median(r[0] for r in results)
        rate = statistics.median(r[1] for r in results)
        peak = int(statistics.median(r[2] for r in results))
        print(f"{method:12} {first:14.2f} {rate:10.0f} {format_bytes(peak):>10}")


if __name__ == "__main__":
    main()

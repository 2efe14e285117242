"""Does the report's headline speedup come true over real epochs?

A spawn-started pipeline whose dataset is Python objects (each worker unpickles its own
copy at start-up, every epoch unless the workers persist), short epochs, a 5 ms step.
``autoloader.tune()`` runs once; then real epochs of the tuned loader and of the
defaults are timed side by side, interleaved, each from ``iter(loader)`` to its last
batch (start-up included, as a training run pays it). The ratio of those epoch times is
what a user gets; the report's headline (``result.speedup``) should say the same, and
the steady ratio (start-up left out) is shown beside it.

    python benchmarks/headline.py [--time-budget 30] [--epochs 3] [--items 4000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import autoloader


class Records(Dataset[torch.Tensor]):
    """Python dicts, parsed per item with pure-Python work (~0.6 ms), as a JSON-lines
    corpus held in memory would be."""

    def __init__(self, items: int) -> None:
        self.records = [
            {"id": i, "text": " ".join(f"w{(i * 7 + j) % 997}" for j in range(60))}
            for i in range(items)
        ]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> torch.Tensor:
        record = self.records[index]
        tokens = [hash(word) % 30_000 for word in record["text"].split()] * 4
        tokens = sorted(tokens)[:64]
        return torch.tensor([record["id"], *tokens], dtype=torch.int64)


def step(batch: torch.Tensor) -> None:
    time.sleep(0.005)  # a step on an accelerator, standing in: it waits, using no CPU


def epoch_seconds(loader: DataLoader[Any]) -> tuple[float, int]:
    started = time.perf_counter()
    seen = 0
    for batch in loader:
        step(batch)
        seen += len(batch)
    return time.perf_counter() - started, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    dataset = Records(args.items)
    fixed = {"multiprocessing_context": "spawn", "shuffle": True}
    result = autoloader.tune(
        dataset,
        step,
        batch_size=args.batch_size,
        time_budget=args.time_budget,
        loader_kwargs=fixed,
        show_progress=False,
    )
    report = autoloader.report(result) if hasattr(autoloader, "report") else result.report()
    print(report, flush=True)

    tuned = result.make_loader(dataset)
    # The defaults load in the main process: DataLoader refuses a start method there.
    default = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    times: dict[str, list[float]] = {"tuned": [], "default": []}
    for epoch in range(args.epochs):  # interleaved, the order alternating
        order = ("tuned", "default") if epoch % 2 == 0 else ("default", "tuned")
        for name in order:
            seconds, seen = epoch_seconds(tuned if name == "tuned" else default)
            assert seen == len(dataset), (name, seen)
            times[name].append(seconds)
    del tuned  # persistent workers stop

    real = statistics.median(times["default"]) / statistics.median(times["tuned"])
    steady = getattr(result, "steady_throughput", None)
    steady_base = getattr(result, "steady_baseline", None)
    print(f"\nsettings: {result.params}")
    print(
        "epoch seconds, tuned:   " + ", ".join(f"{t:.2f}" for t in times["tuned"]),
        "\nepoch seconds, default: " + ", ".join(f"{t:.2f}" for t in times["default"]),
    )
    print(f"real epochs: tuned {real:.2f}x the defaults (median of {args.epochs} each)")
    print(f"report headline (result.speedup): {result.speedup:.2f}x")
    if steady and steady_base:
        print(f"steady ratio (start-up left out): {steady / steady_base:.2f}x")
    print(f"headline / real: {result.speedup / real:.2f}")


if __name__ == "__main__":
    main()

"""A spawn-started pipeline (Windows, macOS, Python 3.14's forkserver): tuned against a
hand grid over whole training runs, and the tuning time against the budget per start
method.

The dataset holds 300,000 Python records, as a table loaded in ``__init__`` does, and
serves a split of ``--split`` of them; each item waits ``--latency`` seconds (a read
from remote storage) and becomes a tensor; batches of 64, a step that sleeps 2 ms (an
accelerator's). Under spawn every worker start pickles the whole table into the worker:
seconds per worker, and again every epoch without persistent workers.

1. ``tune()`` with ``loader_kwargs={"multiprocessing_context": "spawn"}`` and a
   ``--time-budget`` budget; its choice is checked to load every sample of an epoch once.
2. The tuned setting and a hand grid (``num_workers`` 0, 1, 2, 4, each with and without
   persistent workers) each train ``--epochs`` real epochs, timed from the loader's
   construction to the last step (worker start-up and every epoch's restart included);
   ``--rounds`` interleaved rounds, order rotated, median shown.
3. With ``--budgets``, ``tune()`` once more under each start method (fork, forkserver,
   spawn), printing its time against the budget.

    python benchmarks/spawn_pipeline.py [--time-budget 60] [--epochs 3] [--rounds 2]
        [--budgets]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import autoloader

BATCH_SIZE = 64
GRID = [(0, False), (1, False), (1, True), (2, False), (2, True), (4, False), (4, True)]


class Records(Dataset[torch.Tensor]):
    """A table of ``records`` Python dicts, of which the first ``split`` are served."""

    def __init__(self, records: int, split: int, latency: float) -> None:
        self.records = [{"id": i, "values": [float(i)] * 8} for i in range(records)]
        self.split = split
        self.latency = latency

    def __len__(self) -> int:
        return self.split

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.latency)
        record = self.records[index]
        return torch.tensor([float(record["id"]), *record["values"]])


def step(batch: torch.Tensor) -> None:
    time.sleep(0.002)


def loader(dataset: Records, workers: int, persistent: bool, **options: Any) -> DataLoader[Any]:
    kwargs: dict[str, Any] = {"batch_size": BATCH_SIZE, "shuffle": True, "num_workers": workers}
    if workers:
        kwargs.update(multiprocessing_context="spawn", persistent_workers=persistent)
    kwargs.update(options)
    return DataLoader(dataset, **kwargs)


def tune(dataset: Records, method: str, budget: float) -> tuple[autoloader.TuneResult, float]:
    """``tune()`` with ``method`` starting the workers; the result and its seconds."""
    started = time.perf_counter()
    result = autoloader.tune(
        dataset,
        step,
        batch_size=BATCH_SIZE,
        time_budget=budget,
        loader_kwargs={"shuffle": True, "multiprocessing_context": method},
        show_progress=False,
    )
    return result, time.perf_counter() - started


def training_seconds(make: Any, epochs: int) -> float:
    """Seconds to train ``epochs`` epochs with the loader ``make()`` builds, from its
    construction to the last step."""
    started = time.perf_counter()
    built = make()
    for _ in range(epochs):
        for batch in built:
            step(batch)
    seconds = time.perf_counter() - started
    iterator = getattr(built, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()
    return seconds


def epoch_check(built: DataLoader[Any], length: int) -> str:
    ids = [int(i) for batch in built for i in batch[:, 0].tolist()]
    if len(ids) == length and len(set(ids)) == length:
        return "ok"
    return f"{len(ids)} samples, {len(set(ids))} distinct, of {length}"


def describe(params: dict[str, Any]) -> str:
    workers = params["num_workers"]
    if not workers:
        return "0 workers"
    persistent = ", persistent" if params.get("persistent_workers") else ""
    return f"{workers} workers, prefetch {params.get('prefetch_factor')}{persistent}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=60.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--split", type=int, default=8_000)
    parser.add_argument("--latency", type=float, default=0.001)
    parser.add_argument("--budgets", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    logging.basicConfig(level=logging.WARNING)
    dataset = Records(args.records, args.split, args.latency)

    result, tuning = tune(dataset, "spawn", args.time_budget)
    print(autoloader.report(result), "\n")
    tuned = result.params
    check = epoch_check(result.make_loader(dataset), len(dataset))
    print(f"tuned: {describe(tuned)} in {tuning:.1f} s of {args.time_budget:.0f}; epoch {check}")

    settings: dict[str, Any] = {
        describe({"num_workers": w, "persistent_workers": p, "prefetch_factor": 2}): (
            lambda w=w, p=p: loader(dataset, w, p)
        )
        for w, p in GRID
    }
    settings["tuned"] = lambda: result.make_loader(dataset)
    times: dict[str, list[float]] = {name: [] for name in settings}
    names = list(settings)
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(training_seconds(settings[name], args.epochs))
            print(f"  round {round_ + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    best = min((n for n in medians if n != "tuned"), key=medians.__getitem__)
    print(f"\n{args.epochs} epochs of {len(dataset):,} samples, spawn, median of {args.rounds}")
    print("| setting | seconds | samples/s | / best hand |")
    print("|---|---|---|---|")
    samples = args.epochs * len(dataset)
    for name, seconds in sorted(medians.items(), key=lambda item: item[1]):
        label = f"tuned ({describe(tuned)})" if name == "tuned" else name
        ratio = medians[best] / seconds
        print(f"| {label} | {seconds:.1f} | {samples / seconds:,.0f} | {ratio:.3f} |")

    if args.budgets:
        print("\n| start method | tuning s | budget s | ratio | chosen |")
        print("|---|---|---|---|---|")
        for method in ("fork", "forkserver", "spawn"):
            again, seconds = tune(dataset, method, args.time_budget)
            print(
                f"| {method} | {seconds:.1f} | {args.time_budget:.0f} | "
                f"{seconds / args.time_budget:.3f} | {describe(again.params)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

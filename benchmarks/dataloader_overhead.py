"""What a DataLoader can deliver at best here: the loop with a dataset that costs nothing.

With items that load instantly, the loop's time per batch is the step plus the
DataLoader's own per-batch cost (receiving the batch from a worker: a pipe read, a file
descriptor passed over a socket, unpickling, profiler hooks). That sum, not
batch_size / step_time, is the ceiling a tuner can reach on this machine. Also shows the
same loop with the workers sharing tensors through the "file_system" strategy, and
with thread workers (``autoloader.ThreadLoader``), which hand a batch over as a
reference, and the step alone (``time.sleep`` oversleeps: the step's real ceiling).

    python benchmarks/dataloader_overhead.py [--batch-size 8] [--step 0.010] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, Dataset

from autoloader import ThreadLoader


class Instant(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10**7

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(16)


def _file_system_sharing(worker_id: int) -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")


def loop_rate(
    workers: int | None, batch_size: int, step: float, batches: int, **kwargs: object
) -> tuple[float, float]:
    """Samples/s of next()+step, and milliseconds per batch spent in next(). A negative
    ``workers`` count means that many thread workers; ``None`` the step alone."""
    if workers is None:
        started = time.perf_counter()
        for _ in range(batches):
            time.sleep(step)
        return batch_size * batches / (time.perf_counter() - started), 0.0
    kind = ThreadLoader if workers < 0 else DataLoader
    loader = kind(
        Instant(),
        batch_size=batch_size,
        num_workers=abs(workers),
        persistent_workers=workers > 0,
        **kwargs,  # type: ignore[arg-type]
    )
    iterator = iter(loader)
    for _ in range(max(20, 4 * abs(workers))):
        next(iterator)
        time.sleep(step)
    waited = 0.0
    started = time.perf_counter()
    for _ in range(batches):
        before = time.perf_counter()
        next(iterator)
        waited += time.perf_counter() - before
        time.sleep(step)
    elapsed = time.perf_counter() - started
    del iterator, loader
    return batch_size * batches / elapsed, 1000 * waited / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--step", type=float, default=0.010)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    ceiling = args.batch_size / args.step
    configs: list[tuple[str, int | None, dict[str, object]]] = [
        ("the step alone", None, {}),
        ("num_workers=0", 0, {}),
        ("num_workers=2", 2, {}),
        ("num_workers=6", 6, {}),
        ("num_workers=12", 12, {}),
        ("num_workers=6, file_system sharing", 6, {"worker_init_fn": _file_system_sharing}),
        ("ThreadLoader, 2 threads", -2, {}),
        ("ThreadLoader, 6 threads", -6, {}),
    ]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in configs}
    for _ in range(args.rounds):  # interleaved: A B C ... A B C ...
        for name, workers, kwargs in configs:
            results[name].append(
                loop_rate(workers, args.batch_size, args.step, args.batches, **kwargs)
            )
    print(
        f"batch {args.batch_size}, step {args.step * 1000:.0f} ms: "
        f"ceiling {ceiling:.0f} samples/s; "
        f"{args.rounds} interleaved rounds of {args.batches} batches"
    )
    print(f"{'setting':<38}{'samples/s (min-max)':>24}{'/ceiling':>10}{'next() ms':>11}")
    for name, runs in results.items():
        rates = [r for r, _ in runs]
        median = statistics.median(rates)
        wait = statistics.median(w for _, w in runs)
        spread = f"({min(rates):.0f}-{max(rates):.0f})"
        print(f"{name:<38}{median:>10.0f} {spread:<13}{median / ceiling:>10.3f}{wait:>11.2f}")


if __name__ == "__main__":
    main()

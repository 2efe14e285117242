"""Does torch's inter-op pool matter to a step that trains on the CPU?

``step_threads`` tunes the intra-op pool (``torch.set_num_threads``) and leaves the
inter-op pool alone (``NOTE [ Step threads ]``): torch lets a process set it once,
before any inter-op work, so it cannot be set per trial. This measures whether that
loses anything: the steps of the corpus's CPU-trained CNNs (``pipelines.py``), timed on
one batch in fresh processes with ``torch.set_num_interop_threads(n)`` for each ``n``,
the intra-op pool at 1 and at every CPU, interleaved over rounds.

    python benchmarks/interop_threads.py [--rounds 5] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _time_steps(pipeline: str, interop: int, intra: int, steps: int) -> float:
    """Steps per second of ``pipeline``'s step on one batch, in this process."""
    import torch

    torch.set_num_interop_threads(interop)
    torch.set_num_threads(intra)
    sys.path.insert(0, str(HERE))
    from pipelines import TrainCnn

    step = TrainCnn(channels=(8, 16) if pipeline == "cpu-train-small" else (16, 32))
    batch_size = 32 if pipeline == "cpu-train-small" else 64
    batch = {
        "image": torch.randn(batch_size, 3, 64, 64),
        "label": torch.randint(0, 10, (batch_size,)),
    }
    for _ in range(5):  # warm-up
        step(batch)
    started = time.perf_counter()
    for _ in range(steps):
        step(batch)
    return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        pipeline, interop, intra, steps = args.child
        print(json.dumps(_time_steps(pipeline, int(interop), int(intra), int(steps))))
        return
    cpus = len(os.sched_getaffinity(0))
    settings = [
        (pipeline, interop, intra)
        for pipeline in ("cpu-train", "cpu-train-small")
        for intra in sorted({1, cpus})
        for interop in sorted({1, cpus})
    ]
    rates: dict[tuple[str, int, int], list[float]] = {s: [] for s in settings}
    for round_number in range(args.rounds):
        shift = round_number % len(settings)
        for setting in settings[shift:] + settings[:shift]:
            command = [sys.executable, __file__, "--child", *map(str, setting), str(args.steps)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rates[setting].append(json.loads(out))
    print(f"steps/s, median (min-max) of {args.rounds} fresh processes each, {cpus} CPUs:")
    print("| pipeline | intra-op threads | inter-op threads | steps/s |")
    print("|---|---|---|---|")
    for (pipeline, interop, intra), values in rates.items():
        print(
            f"| {pipeline} | {intra} | {interop} | {statistics.median(values):.1f} "
            f"({min(values):.1f}-{max(values):.1f}) |"
        )


if __name__ == "__main__":
    main()

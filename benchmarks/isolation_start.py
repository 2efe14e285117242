"""Trials under ``isolation="subprocess"``: forked from one helper a run, or each spawned.

Two measures, each with the two starters interleaved (forked, spawned, forked, ...), in
fresh processes, so neither inherits the other's imports or page cache alone:

- ``trial``: one runner measures ``--trials`` settings of a latency-bound dataset,
  0.5 s each; the seconds each trial cost the run (``Measurement.duration``: its process
  started, its dataset loaded, its workers started and timed, its process ended), the
  first apart (a forked run's first trial also waits for its helper), and the CPU the
  run used (this process and its children, ``getrusage``);
- ``tune``: ``autoloader.tune(..., isolation="subprocess", time_budget=--budget)`` over
  the same dataset and a 2 ms step: how many trials it finished, the speed-up it found.

The spawned runs replace ``trial_starter`` with ``Spawner``, as on a platform without
pidfds (``NOTE [ A helper forks the trials ]``).

    python benchmarks/isolation_start.py [--rounds 3] [--trials 6] [--budget 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, resource, sys, time
import autoloader
import autoloader.measure._isolation as isolation
from autoloader.loader._params import normalize_params
from autoloader.measure._deadlines import Deadlines
from autoloader.measure._trial_processes import Spawner
from autoloader.measure._runner import TrialRunner
from benchmarks.isolation_start import LatencyDataset, step_2ms

def cpu():
    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

if __name__ == "__main__":
    kind, measure, trials, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    if kind == "spawned":
        isolation.trial_starter = Spawner
    dataset = LatencyDataset()
    began, used = time.perf_counter(), cpu()
    if measure == "trial":
        runner = isolation.SubprocessRunner(
            TrialRunner(dataset, step_2ms, batch_size=16, memory_budget=2**40))
        with runner:
            durations = [
                runner.measure(normalize_params({"num_workers": 1 + i % 4}), max_seconds=0.5,
                               deadlines=Deadlines(first=30, each=30)).duration
                for i in range(trials)
            ]
        out = {"durations": durations}
    else:
        result = autoloader.tune(dataset, step_2ms, batch_size=16, time_budget=budget,
                                 isolation="subprocess", show_progress=False)
        out = {"trials": sum(t.state == "complete" for t in result.trials),
               "speedup": result.speedup, "params": result.params}
    out |= {"wall": time.perf_counter() - began, "cpu": cpu() - used}
    print(json.dumps(out))
"""


class LatencyDataset:
    """4096 items of 1 ms each (a read): wants workers."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> object:
        import torch

        time.sleep(0.001)
        return torch.full((64,), float(index))


def step_2ms(batch: object) -> None:
    time.sleep(0.002)


def _run(kind: str, measure: str, trials: int, budget: float) -> dict[str, Any]:
    ran = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, measure, str(trials), str(budget)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(json.loads(ran.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--budget", type=float, default=15.0)
    args = parser.parse_args()
    kinds = ("forked", "spawned")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for measure in ("trial", "tune"):
        for round_ in range(args.rounds):
            for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
                out = _run(kind, measure, args.trials, args.budget)
                runs.setdefault((kind, measure), []).append(out)
                print(measure, kind, round_, json.dumps(out), flush=True)
    print(f"\nisolation='subprocess', {args.rounds} rounds each, interleaved")
    print("| starter | first trial s | later trials s (median) | CPU s a run | "
          f"trials in {args.budget:.0f} s | speed-up |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        trial, tune = runs[(kind, "trial")], runs[(kind, "tune")]
        firsts = [run["durations"][0] for run in trial]
        later = [d for run in trial for d in run["durations"][1:]]
        cpus = [run["cpu"] for run in trial]
        counts = [run["trials"] for run in tune]
        speedups = [f"{run['speedup']:.2f}" for run in tune]
        print(
            f"| {kind} | {statistics.median(firsts):.2f} | {statistics.median(later):.2f} "
            f"| {statistics.median(cpus):.1f} | {', '.join(map(str, counts))} "
            f"| {', '.join(speedups)} |"
        )


if __name__ == "__main__":
    main()

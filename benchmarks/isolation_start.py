"""Trials under ``isolation="subprocess"``: forked from one helper a run, or each spawned.

Two measures, each with the two starters interleaved (forked, spawned, forked, ...), in
fresh processes, so neither inherits the other's imports or page cache alone:

- ``trial``: one runner measures ``--trials`` settings of a latency-bound dataset,
  0.5 s each; the seconds each trial cost the run (``Measurement.duration``: its process
  started, its dataset loaded, its workers started and timed, its process ended), the
  first apart (a forked run's first trial also waits for its helper), and the CPU the
  run used (this process and its children, ``getrusage``);
- ``tune``: ``autoloader.tune(..., isolation="subprocess", time_budget=--budget)`` over
  the same dataset and a 2 ms step: how many trials it finished, the speed-up it found;
  with ``--pipelines``, over those of the real-pipelines corpus too
  (``benchmarks/pipelines.py``: JPEG files and PIL, HF ``datasets`` with a tokenizer,
  h5py), then one epoch of the tuned loader against the dataset (every sample once).

The spawned runs replace ``trial_starter`` with ``Spawner``, as on a platform without
pidfds (``NOTE [ A helper forks the trials ]``).

    python benchmarks/isolation_start.py [--rounds 3] [--trials 6] [--budget 15]
        [--pipelines images,hf-text,hdf5 --data /tmp/benchdata]
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
    elif measure == "tune":
        result = autoloader.tune(dataset, step_2ms, batch_size=16, time_budget=budget,
                                 isolation="subprocess", show_progress=False)
        out = {"trials": sum(t.state == "complete" for t in result.trials),
               "speedup": result.speedup, "params": result.params}
    else:  # a pipeline of the corpus, its data under sys.argv[5]
        from benchmarks.pipelines import build, train_epoch
        pipeline = build(measure, sys.argv[5])
        result = autoloader.tune(pipeline.dataset, pipeline.step,
                                 batch_size=pipeline.batch_size, time_budget=budget,
                                 loader_kwargs=pipeline.loader_kwargs,
                                 isolation="subprocess", show_progress=False)
        seconds, samples, check = train_epoch(result.make_loader(pipeline.dataset), pipeline)
        out = {"trials": sum(t.state == "complete" for t in result.trials),
               "speedup": result.speedup, "params": result.params,
               "epoch": f"{samples / seconds:.0f}/s {check}"}
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


def _run(kind: str, measure: str, trials: int, budget: float, data: str) -> dict[str, Any]:
    ran = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _CHILD,
         kind, measure, str(trials), str(budget), data],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(json.loads(ran.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--budget", type=float, default=15.0)
    parser.add_argument("--pipelines", default="", help="comma-separated names of the corpus")
    parser.add_argument("--data", default="/tmp/benchdata", help="where the corpus's data is")
    args = parser.parse_args()
    kinds = ("forked", "spawned")
    pipelines = [name for name in args.pipelines.split(",") if name]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for measure in ("trial", "tune", *pipelines):
        for round_ in range(args.rounds):
            for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
                out = _run(kind, measure, args.trials, args.budget, args.data)
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
    if pipelines:
        print(f"\nreal pipelines, tune(isolation='subprocess', time_budget={args.budget:.0f})")
        print("| pipeline | starter | trials | speed-up | chosen | one epoch after |")
        print("|---|---|---|---|---|---|")
    for name in pipelines:
        for kind in kinds:
            for run in runs[(kind, name)]:
                chosen = {k: v for k, v in run["params"].items() if v not in (None, False)}
                print(
                    f"| {name} | {kind} | {run['trials']} | {run['speedup']:.2f} "
                    f"| {chosen} | {run['epoch']} |"
                )


if __name__ == "__main__":
    main()

"""Thread workers against worker processes: the tuned setting, the best of each kind.

For each workload, in one run on one machine:

1. ``autoloader.tune()`` with its default search space (which measures both kinds where
   the dataset reads the same from several threads), timed;
2. a grid of each kind, every setting measured once: ``num_workers`` in 1, 2, 4, 8, 12,
   16 and ``prefetch_factor`` in 2, 8 (persistent worker processes);
3. the tuned setting, each kind's best (of its grid's 2 best, the better once
   re-measured) and ``num_workers=0``, measured again side by side, interleaved
   (A B C D A B C D ...), for the same time each. Values are samples per second over a
   training epoch, start-up included (the tuner's objective), and the process tree's
   peak memory; for the records of Python objects, also the peak over one whole epoch
   (``epoch_memory``).

The ceiling is ``batch / step``. No loop quite reaches it: ``time.sleep`` oversleeps
(10.35 ms for 10 ms here) and the loop itself costs a little. So the same loop over
items that cost nothing, at ``num_workers=0``, is measured beside the others ("free
loading"): the ceiling a loader can actually approach on this machine.

    python benchmarks/thread_workers.py [--workloads latency,cpu-python] [--time-budget 30]
        [--rounds 3] [--seconds 1.5] [--remeasure-seconds 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
import warnings
from typing import Any

import torch

from autoloader.loader._factory import build_loader, merge_loader_kwargs
from autoloader.loader._params import BASELINE_PARAMS, normalize_params
from autoloader.measure._memory import MemoryWatch
from autoloader.measure._process_memory import tree_memory
from autoloader.measure._runner import TrialRunner
from autoloader.measure._units import format_bytes
from autoloader.search._known_failures import params_key

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from copy_on_read import Records
from search_quality import Context, tune_workload
from workloads import WORKLOADS, Latency, Workload

GRID_COUNTS = (1, 2, 4, 8, 12, 16)
GRID_PREFETCH = (2, 8)
# The grid's best settings of each kind re-measured before the best is named.
TOP = 2


class LatencyRecords(Records):
    """A list of dicts of Python objects (copied on read by forked workers), and a 5 ms
    wait per item, as a dataset of records that each point at remote storage."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.wait = Latency(length, 0.005)

    def __getitem__(self, index: int) -> Any:
        self.wait[index]
        return super().__getitem__(index)


THREAD_WORKLOADS = {
    **{name: WORKLOADS[name] for name in ("latency", "jitter", "cpu-python", "cpu-blas", "tensor")},
    "records": Workload(
        "records",
        "200k dicts of Python objects (copied on read), 5 ms wait per item",
        LatencyRecords,
        200_000,
        8,
        0.010,
    ),
}


def kind_grid(context: Context, kind: str, seconds: float) -> list[tuple[float, dict[str, Any]]]:
    """Every grid setting of ``kind`` measured once, best first."""
    values = []
    for workers in GRID_COUNTS:
        for prefetch in GRID_PREFETCH:
            params = normalize_params(
                {
                    "num_workers": workers,
                    "prefetch_factor": prefetch,
                    "persistent_workers": True,
                    "worker_kind": kind,
                }
            )
            measured = context.measure(params, seconds)
            values.append((0.0 if measured is None else context.value(params, measured), params))
    return sorted(values, key=lambda item: item[0], reverse=True)


class Free(Latency):
    """Items that cost nothing: the loop's own ceiling."""

    def __getitem__(self, index: int) -> Any:
        return torch.zeros(64)


def side_by_side(
    context: Context,
    free: Context,
    candidates: dict[str, dict[str, Any]],
    rounds: int,
    seconds: float,
) -> dict[str, tuple[list[float], list[int]]]:
    """Each distinct setting measured ``rounds`` times in turn, and the loop over free
    items (key ``"free"``) in the same rounds: values and peak memory."""
    distinct = {params_key(p): (context, p) for p in candidates.values()}
    distinct["free"] = (free, BASELINE_PARAMS)
    runs: dict[str, tuple[list[float], list[int]]] = {key: ([], []) for key in distinct}
    for _ in range(rounds):
        for key, (where, params) in distinct.items():
            measured = where.measure(params, seconds, to_the_cap=True)
            runs[key][0].append(0.0 if measured is None else where.value(params, measured))
            runs[key][1].append(0 if measured is None else measured.peak_memory)
    return runs


def _show(params: dict[str, Any]) -> str:
    if not params["num_workers"]:
        return "num_workers=0"
    parts = [
        f"{params['num_workers']} {params['worker_kind']}",
        f"prefetch {params['prefetch_factor']}",
    ]
    if params["persistent_workers"]:
        parts.append("persistent")
    if params.get("worker_threads"):
        parts.append(f"{params['worker_threads']} native thread(s) each")
    if params.get("batched_fetch"):
        parts.append("batched")
    if not params.get("in_order", True):
        parts.append("out of order")
    return ", ".join(parts)


def run_workload(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    dataset = workload.make_dataset(workload.length)
    step = workload.step()
    result, tune_seconds = tune_workload(workload, dataset, step, args.time_budget)
    kinds = {t.params.get("worker_kind") for t in result.trials if t.params["num_workers"]}
    print(f"tuned in {tune_seconds:.1f} s ({len(result.trials)} trials, kinds measured: "
          f"{sorted(k for k in kinds if k)}): {_show(result.params)}", flush=True)  # fmt: skip

    runner = TrialRunner(
        dataset, step, batch_size=workload.batch_size, memory_budget=tree_memory() + (8 << 30)
    )
    batches_per_epoch = len(dataset) // workload.batch_size  # type: ignore[arg-type]
    context = Context(workload, runner, batches_per_epoch)
    free_runner = TrialRunner(
        Free(len(dataset)),  # type: ignore[arg-type]
        step,
        batch_size=workload.batch_size,
        memory_budget=runner.memory_budget,
    )
    free = Context(workload, free_runner, batches_per_epoch)
    baseline = context.measure(BASELINE_PARAMS, args.seconds)
    assert baseline is not None
    context.refill_seconds = baseline.load_seconds
    grids = {kind: kind_grid(context, kind, args.seconds) for kind in ("processes", "threads")}
    candidates = {"tuned": result.params, "num_workers=0": BASELINE_PARAMS}
    for kind, ranked in grids.items():
        for i, (_, params) in enumerate(ranked[:TOP]):
            candidates[f"{kind} #{i + 1}"] = params
    runs = side_by_side(context, free, candidates, args.rounds, args.remeasure_seconds)

    def median(name: str) -> float:
        return statistics.median(runs[params_key(candidates[name])][0])

    for kind in grids:
        best = max((f"{kind} #{i + 1}" for i in range(TOP)), key=median)
        candidates[f"best {kind}"] = candidates[best]
    print(f"{'setting':16} {'samples/s':>9} {'(min-max)':>13} {'/ceiling':>8} {'peak memory':>12}"
          "  params")  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    for name in ("tuned", "best processes", "best threads", "num_workers=0"):
        values, peaks = runs[params_key(candidates[name])]
        rows[name] = {
            "samples_per_second": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "peak_memory": max(peaks),
            "params": candidates[name],
        }
        print(f"{name:16} {rows[name]['samples_per_second']:9.0f} ({min(values):5.0f}-"
              f"{max(values):5.0f}) {rows[name]['samples_per_second'] / workload.ceiling:8.3f} "
              f"{format_bytes(max(peaks)):>12}  {_show(candidates[name])}")  # fmt: skip
    free_loading = statistics.median(runs["free"][0])
    print(f"{'free loading':16} {free_loading:9.0f} ({min(runs['free'][0]):5.0f}-"
          f"{max(runs['free'][0]):5.0f}) {free_loading / workload.ceiling:8.3f}")  # fmt: skip
    tuned = rows["tuned"]["samples_per_second"]
    summary = {
        "workload": workload.name,
        "ceiling": workload.ceiling,
        "free_loading": free_loading,
        "tune_seconds": tune_seconds,
        "tuned_over_ceiling": tuned / workload.ceiling,
        "tuned_over_free_loading": tuned / free_loading,
        "tuned_over_best_processes": tuned / rows["best processes"]["samples_per_second"],
        "tuned_over_best_threads": tuned / rows["best threads"]["samples_per_second"],
        "rows": rows,
    }
    print(f"tuned/ceiling {summary['tuned_over_ceiling']:.3f}, tuned/free loading "
          f"{summary['tuned_over_free_loading']:.3f}, tuned/best processes "
          f"{summary['tuned_over_best_processes']:.3f}, tuned/best threads "
          f"{summary['tuned_over_best_threads']:.3f}")  # fmt: skip
    return summary


def epoch_memory(records: dict[str, Any], length: int) -> dict[str, int]:
    """The process tree's peak memory (PSS, sampled every 0.1 s) over one whole epoch of
    ``Records(length)`` (no wait, no step: a trial's few seconds read too few items to
    show what copy-on-read costs), for the tuned setting and the best with processes of
    the ``records`` workload. Each loader is built afresh over a dataset made first."""
    dataset = Records(length)
    peaks = {}
    for name in ("tuned", "best processes"):
        params = records["rows"][name]["params"]
        loader = build_loader(
            dataset, merge_loader_kwargs(params, batch_size=8, fixed={}, overrides={})
        )
        watch = MemoryWatch(1 << 60).start()
        started = time.perf_counter()
        items = sum(len(batch) for batch in loader)
        seconds = time.perf_counter() - started
        watch.stop()
        del loader
        peaks[name] = watch.peak
        print(f"one epoch of {items:,} records, {_show(params)}: peak "
              f"{format_bytes(watch.peak)} in {seconds:.1f} s")  # fmt: skip
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(THREAD_WORKLOADS))
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.5, help="per grid trial")
    parser.add_argument("--remeasure-seconds", type=float, default=3.0)
    parser.add_argument("--json", help="write the summary rows here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    print(f"Python {sys.version.split()[0]}"
          f"{' (free-threaded build)' if sysconfig.get_config_var('Py_GIL_DISABLED') else ''}, "
          f"GIL {'enabled' if gil else 'disabled'}; {os.cpu_count()} CPUs")  # fmt: skip
    summaries = [run_workload(THREAD_WORKLOADS[name], args) for name in args.workloads.split(",")]
    for summary in summaries:
        if summary["workload"] == "records":
            summary["epoch_peak_memory"] = epoch_memory(summary, THREAD_WORKLOADS["records"].length)
    print(f"\n{'workload':12} {'tuned/ceiling':>13} {'tuned/free':>10} {'tuned/best proc':>15} "
          f"{'tuned/best thr':>14}  tuned")  # fmt: skip
    for s in summaries:
        print(f"{s['workload']:12} {s['tuned_over_ceiling']:13.3f} "
              f"{s['tuned_over_free_loading']:10.3f} "
              f"{s['tuned_over_best_processes']:15.3f} {s['tuned_over_best_threads']:14.3f}  "
              f"{_show(s['rows']['tuned']['params'])}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as file:
            json.dump(summaries, file, indent=2)


if __name__ == "__main__":
    main()

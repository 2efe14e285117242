"""Tuned settings against the exhaustive grid, the folklore heuristics and no workers.

For each workload, in one run on one machine:

1. ``autoloader.tune()`` with its default search space, timed;
2. the exhaustive grid over the same space, timed, with prefetch_factor in 1, 2, 4, 8
   (the tuner may pick any of 1-8). Each setting is measured once for both values of
   persistent_workers: that option only changes the epoch model's start-up term, which
   the one measurement gives for both (so the grid costs half of what measuring both
   would);
3. the tuned setting, the grid's 3 best (the best of them, re-measured, is the
   oracle), ``num_workers=0``, the folklore heuristics (workers = cores, 2 x cores,
   cores / 2, with DataLoader's defaults otherwise) and, for each new option the space
   searches (batched_fetch, worker_threads, in_order), the grid's best setting with
   each of its values, all measured again, interleaved (A B C ... A B C ...), for the
   same time each (3 s: the length of the tuner's own trials at a 30 s budget).

Values are samples per second over a training epoch, start-up included (the tuner's
objective, ``NOTE [ Epoch model ]`` in ``autoloader/search/_objective.py``).

The workloads (``benchmarks/workloads.py``) include heavy-tailed latency (``jitter``:
log-normal per item, sigma 1) and faults that come with the worker index
(``crash-at-4``, ``hang-at-4``: workers 3 and up crash or hang, so at most 3 work).
The grid does not run their failing counts (a hang would cost its deadline each
time): they are worth 0, and the oracle is the best count that works.

    python benchmarks/search_quality.py [--workloads latency,tensor] [--time-budget 30]
        [--rounds 3] [--seconds 2] [--remeasure-seconds 3] [--sizes]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import psutil

import autoloader
from autoloader.checks._batched_fetch import batched_fetch_problem
from autoloader.loader._params import BASELINE_PARAMS, normalize_params
from autoloader.measure._deadlines import Deadlines
from autoloader.measure._errors import TrialError
from autoloader.measure._measurement import Measurement
from autoloader.measure._memory import MemoryBudgetExceeded
from autoloader.measure._process_memory import tree_memory
from autoloader.measure._runner import TrialRunner
from autoloader.measure._units import format_bytes
from autoloader.search._known_failures import params_key
from autoloader.search._objective import epoch_samples_per_second
from autoloader.search._space import SearchSpace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from revisions import setting, tune_now_and_before
from workloads import WORKLOADS, Workload

DEADLINES = Deadlines(first=60, each=60)
# Grid settings re-measured before the best of them is named the oracle.
TOP = 3


@dataclass
class Context:
    workload: Workload
    runner: TrialRunner
    batches_per_epoch: int
    refill_seconds: float = 0.0

    def __post_init__(self) -> None:
        # The same loop, measured for the whole time given, not until the rate is stable.
        self.to_the_cap = TrialRunner(
            self.runner.dataset,
            self.runner.step_fn,
            batch_size=self.runner.batch_size,
            memory_budget=self.runner.memory_budget,
            target_relative_error=0.0,
        )

    def value(self, params: dict[str, Any], measurement: Measurement) -> float:
        return epoch_samples_per_second(
            params,
            measurement,
            batch_size=self.workload.batch_size,
            batches_per_epoch=self.batches_per_epoch,
            refill_seconds=self.refill_seconds,
        )

    def measure(
        self, params: dict[str, Any], seconds: float, *, to_the_cap: bool = False
    ) -> Measurement | None:
        """One measurement, or ``None`` if the setting passed the memory budget or fails
        (a workload's faulty worker counts are not run: a hang would cost its deadline)."""
        fails_from = self.workload.fails_from
        # The faults come with a worker process's index: thread workers never meet them.
        processes = params.get("worker_kind") != "threads"
        if fails_from is not None and processes and params["num_workers"] >= fails_from:
            return None
        runner = self.to_the_cap if to_the_cap else self.runner
        try:
            return runner.measure(params, max_seconds=seconds, deadlines=DEADLINES)
        except (MemoryBudgetExceeded, TrialError):
            return None


def folklore(cpus: int) -> dict[str, dict[str, Any]]:
    return {
        f"workers = cores ({cpus})": normalize_params({"num_workers": cpus}),
        f"workers = 2 x cores ({2 * cpus})": normalize_params({"num_workers": 2 * cpus}),
        f"workers = cores / 2 ({max(1, cpus // 2)})": normalize_params(
            {"num_workers": max(1, cpus // 2)}
        ),
    }


GRID_PREFETCH = (1, 2, 4, 8)
# Options searched besides the worker count and prefetch, with the value that is not
# DataLoader's usual behaviour.
NEW_BEHAVIOUR: dict[str, Any] = {"batched_fetch": True, "worker_threads": 1, "in_order": False}
KNOBS = tuple(NEW_BEHAVIOUR)


def grid(context: Context, space: SearchSpace, seconds: float) -> tuple[dict[str, float], float]:
    """The value of every setting in ``space``, and the seconds the grid took."""
    started = time.perf_counter()
    low, high = space.num_workers  # type: ignore[misc]
    prefetch_low, prefetch_high = space.prefetch_factor  # type: ignore[misc]
    prefetch_grid = [p for p in GRID_PREFETCH if prefetch_low <= p <= prefetch_high]
    values: dict[str, float] = {}
    for workers in range(low, high + 1):
        prefetches: list[int | None] = [None] if workers == 0 else list(prefetch_grid)
        knobs = [getattr(space, k) if workers or k == "batched_fetch" else [None] for k in KNOBS]
        for prefetch, *chosen in itertools.product(prefetches, *knobs):
            measured = normalize_params(
                {
                    "num_workers": workers,
                    "prefetch_factor": prefetch,
                    "persistent_workers": True,
                    **{k: v for k, v in zip(KNOBS, chosen, strict=True) if v is not None},
                }
            )
            m = context.measure(measured, seconds)
            for persistent in space.persistent_workers if workers else [False]:  # type: ignore[union-attr]
                params = {**measured, "persistent_workers": persistent and workers > 0}
                values[params_key(params)] = 0.0 if m is None else context.value(params, m)
    return values, time.perf_counter() - started


def knob_candidates(values: dict[str, float], space: SearchSpace) -> dict[str, dict[str, Any]]:
    """For each option the space searches, the grid's best setting with each value."""
    candidates = {}
    for knob in KNOBS:
        choices = getattr(space, knob)
        if len(choices) < 2:
            continue
        for choice in choices:
            keys = [k for k in values if json.loads(k)[knob] == choice]
            if knob != "batched_fetch":  # the option exists only with workers
                keys = [k for k in keys if json.loads(k)["num_workers"] > 0]
            best = max(keys, key=values.__getitem__)
            candidates[f"best with {knob}={choice}"] = json.loads(best)
    return candidates


def interleaved(
    context: Context, candidates: dict[str, dict[str, Any]], rounds: int, seconds: float
) -> dict[str, list[float]]:
    """Each distinct setting measured ``rounds`` times, in turn, for ``seconds`` each."""
    distinct = {params_key(p): p for p in candidates.values()}
    values: dict[str, list[float]] = {key: [] for key in distinct}
    for _ in range(rounds):
        for key, params in distinct.items():
            m = context.measure(params, seconds, to_the_cap=True)
            values[key].append(0.0 if m is None else context.value(params, m))
    return values


def heading(workload: Workload, budget: int | None = None) -> None:
    print(f"\n== {workload.name}: {workload.describe}; batch {workload.batch_size}, "
          f"step {workload.step_seconds * 1000:.0f} ms, ceiling {workload.ceiling:.0f} samples/s"
          + (f", memory budget {format_bytes(budget)}" if budget else ""), flush=True)  # fmt: skip


def tune_both(
    workload: Workload, args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What this checkout's tune() and the one at ``args.before`` choose for ``workload``,
    each in a fresh process (``revisions.py``); which goes first alternates by workload."""
    heading(workload)
    found = tune_now_and_before(
        args.before,
        before_first=bool(list(WORKLOADS).index(workload.name) % 2),
        time_budget=args.time_budget,
        workload=workload.name,
    )
    for which, one in found.items():
        if "error" in one:
            raise RuntimeError(f"tune() {which} refused {workload.name}: {one['error']}")
    return found["now"], found["before"]


def tune_workload(
    workload: Workload, dataset: Any, step: Any, time_budget: float, budget: int | None = None
) -> tuple[autoloader.TuneResult, float]:
    """Print the workload's heading, then tune it with the default search space: the
    result and the seconds it took."""
    heading(workload, budget)
    started = time.perf_counter()
    result = autoloader.tune(
        dataset,
        step,
        batch_size=workload.batch_size,
        time_budget=time_budget,
        memory_budget=budget,
        search_space=workload.search_space,
        show_progress=False,
    )
    return result, time.perf_counter() - started


def run_workload(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    cpus = len(psutil.Process().cpu_affinity() or []) or os.cpu_count() or 1
    dataset = workload.make_dataset(workload.length)
    step = workload.step()
    budget = None if workload.memory_budget is None else tree_memory() + workload.memory_budget
    before: dict[str, Any] | None = None
    if args.before:
        now, before = tune_both(workload, args)
        tuned_params, tune_seconds = now["params"], now["seconds"]
    else:
        result, tune_seconds = tune_workload(workload, dataset, step, args.time_budget, budget)
        tuned_params = result.params
        print(f"tuned in {tune_seconds:.1f} s ({len(result.trials)} trials): {result.params}")

    batches_per_epoch = len(dataset) // workload.batch_size  # type: ignore[arg-type]
    runner = TrialRunner(
        dataset,
        step,
        batch_size=workload.batch_size,
        memory_budget=budget or tree_memory() + 8 * 1024**3,
    )
    context = Context(workload, runner, batches_per_epoch)
    baseline = context.measure(BASELINE_PARAMS, args.seconds)
    assert baseline is not None
    context.refill_seconds = baseline.load_seconds
    space, _ = SearchSpace(**workload.search_space).resolve(
        usable_cpus=cpus,
        has_accelerator=False,
        batches_per_epoch=batches_per_epoch,
        batched_fetch_problem=batched_fetch_problem(dataset, workload.batch_size, {}),
    )
    values, grid_seconds = grid(context, space, args.seconds)
    top = sorted(values, key=values.__getitem__, reverse=True)[:TOP]
    print(f"grid of {len(values)} settings in {grid_seconds:.1f} s; best {top[0]}")

    candidates = {
        "tuned": tuned_params,
        **({f"tuned at {args.before}": before["params"]} if before else {}),
        **{f"grid #{i + 1}": json.loads(key) for i, key in enumerate(top)},
        "num_workers=0": BASELINE_PARAMS,
        **folklore(cpus),
        **knob_candidates(values, space),
    }
    measured = interleaved(context, candidates, args.rounds, args.remeasure_seconds)
    # The oracle: the best of the grid's top settings once re-measured side by side; a
    # single grid measurement can flatter a setting.
    oracle_key = max(top, key=lambda key: statistics.median(measured[key]))
    candidates["oracle"] = json.loads(oracle_key)
    medians = {}
    print(f"{'setting':34} {'samples/s':>9} {'(min-max)':>13} {'/ceiling':>8}  params")
    for name, params in candidates.items():
        runs = measured[params_key(params)]
        medians[name] = statistics.median(runs)
        print(f"{name:34} {medians[name]:9.0f} ({min(runs):5.0f}-{max(runs):5.0f}) "
              f"{medians[name] / workload.ceiling:8.2f}  {params}")  # fmt: skip
    best_heuristic = max(v for k, v in medians.items() if k.startswith("workers ="))
    knobs = {k: v for k, v in medians.items() if k.startswith("best with")}
    row = {
        "workload": workload.name,
        "ceiling": workload.ceiling,
        "baseline": medians["num_workers=0"],
        "best_heuristic": best_heuristic,
        "oracle": medians["oracle"],
        "tuned": medians["tuned"],
        "tuned_over_oracle": medians["tuned"] / medians["oracle"],
        "tuned_over_heuristic": medians["tuned"] / best_heuristic,
        "tuned_over_ceiling": medians["tuned"] / workload.ceiling,
        "tune_seconds": tune_seconds,
        "grid_seconds": grid_seconds,
        "time_ratio": tune_seconds / grid_seconds,
        "tuned_params": tuned_params,
        "oracle_params": json.loads(oracle_key),
        "knobs": knobs,
    }
    if before:
        row["before"] = medians[f"tuned at {args.before}"]
        row["before_params"] = before["params"]
        row["before_seconds"] = before["seconds"]
    print(f"tuned/oracle {row['tuned_over_oracle']:.3f}, "
          f"tuned/best heuristic {row['tuned_over_heuristic']:.3f}, "
          f"tuning/grid time {row['time_ratio']:.3f}")  # fmt: skip
    return row


def sizes(args: argparse.Namespace) -> None:
    """Tuning time on the latency workload with 1e3 and 1e6 items."""
    workload = WORKLOADS["latency"]
    print("\n== tuning time against dataset size (latency workload)")
    for length in (1_000, 1_000_000):
        started = time.perf_counter()
        result = autoloader.tune(
            workload.make_dataset(length),
            workload.step(),
            batch_size=workload.batch_size,
            time_budget=args.time_budget,
            show_progress=False,
        )
        print(f"{length:>9} items: {time.perf_counter() - started:.1f} s, "
              f"{len(result.trials)} trials, {result.params}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="per grid trial")
    parser.add_argument(
        "--remeasure-seconds",
        type=float,
        default=3.0,
        help="per re-measure trial; as long as the tuner's trials at a 30 s budget, as "
        "shorter ones catch the CPU burst of many workers starting and understate them",
    )
    parser.add_argument("--sizes", action="store_true", help="also time 1e3 vs 1e6 items")
    parser.add_argument("--json", help="write the summary rows here")
    parser.add_argument(
        "--before",
        metavar="REV",
        help="also tune with the code at git revision REV and measure its choice in the "
        "same rounds (each tune() in a fresh process; revisions.py)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    logging.basicConfig(level=logging.WARNING)
    rows = [run_workload(WORKLOADS[name], args) for name in args.workloads.split(",")]
    print(
        "\n| workload | ceiling | num_workers=0 | best heuristic | oracle | tuned | "
        "tuned/oracle | tuned/heuristic | tuned/ceiling | tuning s | grid s | time ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['ceiling']:.0f} | {r['baseline']:.0f} | "
              f"{r['best_heuristic']:.0f} | {r['oracle']:.0f} | {r['tuned']:.0f} | "
              f"{r['tuned_over_oracle']:.3f} | {r['tuned_over_heuristic']:.3f} | "
              f"{r['tuned_over_ceiling']:.2f} | {r['tune_seconds']:.0f} | "
              f"{r['grid_seconds']:.0f} | {r['time_ratio']:.3f} |")  # fmt: skip
    print("\n| workload | option | best with it | best without | with/without |")
    print("|---|---|---|---|---|")
    for r in rows:
        for knob, value in NEW_BEHAVIOUR.items():
            on = f"best with {knob}={value}"
            off = f"best with {knob}={None if knob == 'worker_threads' else not value}"
            if on in r["knobs"] and off in r["knobs"]:
                with_it, without = r["knobs"][on], r["knobs"][off]
                print(f"| {r['workload']} | {knob}={value} | {with_it:.0f} | "
                      f"{without:.0f} | {with_it / without:.2f} |")  # fmt: skip
    if args.before:
        print(f"\n| workload | oracle | tuned now | tuned at {args.before} | now/oracle | "
              f"{args.before}/oracle | now/{args.before} | tuning s (now, {args.before}) | "
              "chosen now | chosen before |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['workload']} | {r['oracle']:.0f} | {r['tuned']:.0f} | "
                  f"{r['before']:.0f} | {r['tuned_over_oracle']:.3f} | "
                  f"{r['before'] / r['oracle']:.3f} | {r['tuned'] / max(r['before'], 1e-9):.3f} | "
                  f"{r['tune_seconds']:.0f}, {r['before_seconds']:.0f} | "
                  f"{setting(r['tuned_params'])} | {setting(r['before_params'])} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=2)
    if args.sizes:
        sizes(args)


if __name__ == "__main__":
    main()

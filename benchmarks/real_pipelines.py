"""The tuner on real pipelines (``pipelines.py``) against a patient person's hand grid.

For each pipeline, in one run on one machine:

1. ``autoloader.diagnose()`` of the loader a new user starts with (``num_workers=0``);
2. ``autoloader.tune()`` with a 40 s budget, timed; what it searched, what it noted;
3. one epoch of the tuned loader against the dataset: every sample once, none lost;
4. the tuned loader and a hand grid of ``num_workers`` 0-4 and 8 (DataLoader's other
   defaults, persistent workers; where the step trains on the CPU, ``num_workers`` 0-4
   times the training process's torch threads, 1 to the CPUs, see
   ``NOTE [ Step threads ]``), measured again side by side: interleaved rounds, the
   order rotated each round, each measurement as a long training run gets it (the
   ``num_workers x prefetch_factor`` batches queued at start-up drained first, then the
   clock running across epochs, their restarts included: with epochs of a few seconds,
   leaving the restarts out favours many workers, whose pipeline takes longer to
   refill), counting unique samples only, so that a loader whose workers repeat each
   other's samples gets no credit for the repeats;
5. the tuned loader and the grid's two best measured again, twice as many rounds: a
   single measurement here varies by +-15%, and the best of six noisy medians is biased
   upwards (several settings are often equal), so the ratio to the best hand setting is
   taken from these rounds.

    python benchmarks/real_pipelines.py [--pipelines images,hdf5] [--time-budget 40]
        [--rounds 4] [--final-rounds 8] [--seconds 5] [--data DIR] [--no-diagnose]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import autoloader
from autoloader.loader import build_loader, merge_loader_kwargs, step_threads
from autoloader.measure._errors import describe_error

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipelines import NAMES, Pipeline, build, epoch_ids
from revisions import setting, tune_now_and_before

HAND_WORKERS = (0, 1, 2, 3, 4, 8)
# Where the step trains on the CPU, each count is measured with every thread count.
CPU_STEP_HAND_WORKERS = (0, 1, 2, 3, 4)


def hand_grid(pipeline: Pipeline) -> dict[str, tuple[int, int | None]]:
    """The hand settings by name: workers, and the training process's torch threads
    (``None``: as they are) where the step trains on the CPU."""
    if not pipeline.cpu_step:
        return {f"num_workers={w}": (w, None) for w in HAND_WORKERS}
    cpus = len(os.sched_getaffinity(0))
    return {
        f"num_workers={w} threads={t}": (w, t)
        for w in CPU_STEP_HAND_WORKERS
        for t in range(1, cpus + 1)
    }


def training_rate(
    loader: DataLoader[Any],
    step: Callable[[Any], object],
    ids: Callable[[Any], list[Any]],
    seconds: float,
) -> float:
    """Unique samples per second of ``next(loader)`` then ``step``, as a long training
    run gets them: the ``num_workers x prefetch_factor`` batches queued at start-up are
    drained once, off the clock; then the clock runs across epochs, each epoch's restart
    (a refill of the pipeline, or new workers without persistent ones) included. A
    sample counts once per epoch."""
    to_skip = loader.num_workers * (loader.prefetch_factor or 0) + 1
    unique, started = 0, 0.0
    iterator = iter(loader)
    try:
        while True:
            seen: set[Any] = set()
            for batch in iterator:
                step(batch)
                new = [i for i in ids(batch) if i not in seen]
                seen.update(new)
                if to_skip:
                    to_skip -= 1
                    started = time.perf_counter()
                    continue
                unique += len(new)
                elapsed = time.perf_counter() - started
                if elapsed >= seconds:
                    return unique / elapsed
            iterator = iter(loader)  # the next epoch, on the clock
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def hand_loader(pipeline: Pipeline, workers: int) -> DataLoader[Any]:
    options = dict(pipeline.loader_kwargs)
    if workers:
        options["persistent_workers"] = True
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        return DataLoader(
            pipeline.dataset, batch_size=pipeline.batch_size, num_workers=workers, **options
        )


def epoch_check(loader: DataLoader[Any], pipeline: Pipeline) -> str:
    """ "ok", or how one epoch of ``loader`` differs from the dataset's samples."""
    counts = collections.Counter(epoch_ids(loader, pipeline.ids))
    repeats = sum(n - 1 for n in counts.values() if n > 1)
    lost = len(set(pipeline.expected) - set(counts))
    return "ok" if not repeats and not lost else f"{repeats} repeated, {lost} lost"


def short_error(error: BaseException) -> str:
    """The exception's type and the line that matters, as autoloader reports it."""
    return describe_error(error)[0][:200]


def run_one(pipeline: Pipeline, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"pipeline": pipeline.name, "what": pipeline.what}
    print(f"\n== {pipeline.name}: {pipeline.what}", flush=True)
    if args.diagnose:
        started = time.perf_counter()
        try:
            diagnosis = autoloader.diagnose(hand_loader(pipeline, 0), pipeline.step)
            row["verdict"] = diagnosis.verdict
            print(str(diagnosis))
        except autoloader.AutoloaderError as error:
            row["verdict"] = f"error: {short_error(error)}"
        row["diagnose_seconds"] = time.perf_counter() - started
        print(f"diagnose: {row['verdict']} in {row['diagnose_seconds']:.1f} s", flush=True)

    settings: dict[str, Callable[[], DataLoader[Any]]] = {}
    threads: dict[str, int | None] = {}
    if args.before:
        finalists_extra = tune_side_by_side(pipeline, args, row, settings, threads)
    else:
        tune_here(pipeline, args, row, settings, threads)
        finalists_extra = []

    for name, (workers, count) in hand_grid(pipeline).items():
        settings[name] = lambda w=workers: hand_loader(pipeline, w)
        threads[name] = count
    failures: dict[str, str] = {}
    rates = interleave(
        settings, list(settings), args.rounds, pipeline, args.seconds, failures, threads
    )
    row["rates"] = {name: (statistics.median(v), min(v), max(v)) for name, v in rates.items() if v}
    row["failures"] = failures
    hand = {n: r[0] for n, r in row["rates"].items() if n.startswith("num_workers=")}
    finalists = sorted(hand, key=hand.__getitem__, reverse=True)[:2]
    if "tuned" in row["rates"] and finalists:
        final = interleave(
            settings,
            ["tuned", *finalists_extra, *finalists],
            args.final_rounds,
            pipeline,
            args.seconds,
            failures,
            threads,
        )
        row["final"] = {
            name: (statistics.median(v), min(v), max(v)) for name, v in final.items() if v
        }
        measured = [name for name in finalists if name in row["final"]]
        if "tuned" in row["final"] and measured:
            best_hand = max(measured, key=lambda name: row["final"][name][0])
            row["best_hand"] = best_hand
            row["ratio"] = row["final"]["tuned"][0] / row["final"][best_hand][0]
            for name in finalists_extra:
                if name in row["final"]:
                    row["before_ratio"] = row["final"][name][0] / row["final"][best_hand][0]
    elif finalists:
        row["best_hand"] = finalists[0]
    print("side by side (unique samples/s, median and min-max of rounds):")
    for name, (median, low, high) in row["rates"].items():
        print(f"  {name:<26} {median:9,.0f}  ({low:,.0f}-{high:,.0f})")
    for name, reason in failures.items():
        print(f"  {name:<16} fails: {reason}")
    if "ratio" in row:
        print(f"the tuned setting(s) and the two best by hand, {args.final_rounds} more rounds:")
        for name, (median, low, high) in row["final"].items():
            print(f"  {name:<26} {median:9,.0f}  ({low:,.0f}-{high:,.0f})")
        same = isinstance(row.get("tuned"), dict) and is_hand_setting(
            row["tuned"], row["best_hand"]
        )
        print(
            f"tuned / best hand ({row['best_hand']}): {row['ratio']:.3f}"
            + (": the same setting, measured twice" if same else ""),
            flush=True,
        )
    return row


def tune_here(
    pipeline: Pipeline,
    args: argparse.Namespace,
    row: dict[str, Any],
    settings: dict[str, Callable[[], DataLoader[Any]]],
    threads: dict[str, int | None],
) -> None:
    """Tune ``pipeline`` in this process; its report, and one epoch of its loader checked."""
    started = time.perf_counter()
    try:
        result = autoloader.tune(
            pipeline.dataset,
            pipeline.step,
            batch_size=pipeline.batch_size,
            time_budget=args.time_budget,
            loader_kwargs=pipeline.loader_kwargs,
            show_progress=False,
        )
    except autoloader.AutoloaderError as error:
        row["tuned"] = f"refused: {short_error(error)}"
        print(f"tune: {error}", flush=True)
    else:
        row["tuned"] = {k: v for k, v in result.params.items()}
        row["claimed_speedup"] = result.speedup
        row["trials"] = dict(collections.Counter(f"{t.phase} {t.state}" for t in result.trials))
        row["notes"] = list(result.notes)
        row["missing"] = dict(result.facts.get("missing") or {})
        print(autoloader.report(result), flush=True)
        row["epoch"] = epoch_check(result.make_loader(pipeline.dataset), pipeline)
        print(f"one epoch of the tuned loader: {row['epoch']}", flush=True)
        settings["tuned"] = lambda: result.make_loader(pipeline.dataset)
        threads["tuned"] = result.params.get("step_threads")  # what apply_threads() sets
    row["tuning_seconds"] = time.perf_counter() - started


def tune_side_by_side(
    pipeline: Pipeline,
    args: argparse.Namespace,
    row: dict[str, Any],
    settings: dict[str, Callable[[], DataLoader[Any]]],
    threads: dict[str, int | None],
) -> list[str]:
    """Tune ``pipeline`` with this checkout and with the code at ``args.before``, each in
    a fresh process; one epoch of each loader checked. The names of the settings to
    measure with the tuned one in the final rounds."""
    extra = []
    both = tune_now_and_before(
        args.before,
        before_first=bool(NAMES.index(pipeline.name) % 2),
        time_budget=args.time_budget,
        pipeline=pipeline.name,
        data=args.data,
    )
    for which, found in both.items():
        name = "tuned" if which == "now" else f"tuned at {args.before}"
        row[which] = found
        if "error" in found:
            continue
        settings[name] = lambda p=found["params"]: tuned_loader(pipeline, p)
        threads[name] = found["params"].get("step_threads")
        found["epoch"] = epoch_check(settings[name](), pipeline)
        print(f"one epoch of the loader tuned {which}: {found['epoch']}", flush=True)
        if which == "before":
            extra.append(name)
    now = row["now"]
    row["tuned"] = f"refused: {now['error'][:200]}" if "error" in now else now["params"]
    row["claimed_speedup"] = now.get("speedup", 0.0)
    row["epoch"] = now.get("epoch", "-")
    row["trials"] = {}  # counted by phase only in this process's tune()
    row["tuning_seconds"] = now["seconds"]
    return extra


def tuned_loader(pipeline: Pipeline, params: dict[str, Any]) -> DataLoader[Any]:
    """The loader ``params`` make for ``pipeline``, as ``TuneResult.make_loader`` builds it."""
    options = merge_loader_kwargs(
        params, batch_size=pipeline.batch_size, fixed=pipeline.loader_kwargs
    )
    return build_loader(pipeline.dataset, options)


def interleave(
    settings: dict[str, Callable[[], DataLoader[Any]]],
    names: list[str],
    rounds: int,
    pipeline: Pipeline,
    seconds: float,
    failures: dict[str, str],
    threads: dict[str, int | None] | None = None,
) -> dict[str, list[float]]:
    """Each setting's unique samples/s, ``rounds`` times, in turns rotated each round,
    each with its training process's torch threads (``threads``, by name)."""
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_number in range(rounds):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            if name in failures:
                continue
            try:
                with step_threads((threads or {}).get(name)):
                    loader = settings[name]()
                    rate = training_rate(loader, pipeline.step, pipeline.ids, seconds)
            except Exception as error:  # a setting the pipeline cannot run with
                failures[name] = short_error(error)
                continue
            rates[name].append(rate)
    return rates


def is_hand_setting(tuned: dict[str, Any], name: str) -> bool:
    """Whether the tuned setting is the hand setting ``name`` (``num_workers=N``, with
    `` threads=T`` where the grid sets the step's threads, DataLoader's defaults
    otherwise, persistent workers): then their ratio is noise."""
    parts = dict(part.split("=") for part in name.split())
    workers = int(parts["num_workers"])
    if tuned.get("num_workers") != workers:
        return False
    if "threads" in parts and tuned.get("step_threads") not in (int(parts["threads"]), None):
        return False
    if workers and (tuned.get("prefetch_factor") != 2 or not tuned.get("persistent_workers")):
        return False
    return not (
        tuned.get("batched_fetch")
        or tuned.get("worker_threads")
        or tuned.get("pin_memory")
        or tuned.get("in_order") is False
    )


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| pipeline | diagnose (num_workers=0) | tuned setting | tuned | best hand | "
        "tuned/best hand | num_workers=0 | speedup measured | speedup claimed | "
        "search trials | tuning s | epoch check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        grid = {name: value[0] for name, value in row.get("rates", {}).items()}
        rates = {**grid, **{name: value[0] for name, value in row.get("final", {}).items()}}
        tuned = row.get("tuned")
        if isinstance(tuned, dict):
            kind = "thread workers" if tuned.get("worker_kind") == "threads" else "workers"
            setting = f"{tuned['num_workers']} {kind}" if tuned["num_workers"] else "0 workers"
            if tuned["num_workers"]:
                setting += f", prefetch {tuned['prefetch_factor']}"
            extras = [k for k in ("batched_fetch",) if tuned.get(k)]
            if tuned.get("worker_threads"):
                extras.append(f"threads {tuned['worker_threads']}")
            if tuned.get("step_threads"):
                extras.append(f"step threads {tuned['step_threads']}")
            setting += "".join(f", {e}" for e in extras)
            searched = sum(n for key, n in row["trials"].items() if key.startswith("search "))
        else:  # refused: the exception's type here, its message in the log
            setting, searched = ":".join(str(tuned).split(":")[:2]), 0
        best = row.get("best_hand")
        measured = "-"  # in the same rounds as num_workers=0
        defaults = "num_workers=0" if "num_workers=0" in grid else _defaults_name(grid)
        if grid.get("tuned") and grid.get(defaults):
            measured = f"{grid['tuned'] / grid[defaults]:.2f}x"
        claimed = f"{row['claimed_speedup']:.2f}x" if "claimed_speedup" in row else "-"
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "-"
        if isinstance(tuned, dict) and best and is_hand_setting(tuned, best):
            ratio += " (the same setting)"
        lines.append(
            f"| {row['pipeline']} | {row.get('verdict', '-')} | {setting} | "
            f"{rates.get('tuned', 0):,.0f} | {best} {rates.get(best, 0):,.0f} | {ratio} | "
            f"{rates.get(defaults, 0):,.0f} | {measured} | {claimed} | "
            f"{searched} | {row['tuning_seconds']:.0f} | {row.get('epoch', '-')} |"
        )
    return "\n".join(lines)


def _defaults_name(grid: dict[str, float]) -> str:
    """The grid's name for DataLoader's defaults where it sets the step's threads: no
    workers, and the process's threads as torch starts them."""
    return f"num_workers=0 threads={torch.get_num_threads()}"


def before_table(rows: list[dict[str, Any]], before: str) -> str:
    """This checkout's choice and the one at ``before``, each against the best hand
    setting in the same final rounds."""
    lines = [
        f"| pipeline | chosen now | chosen at {before} | now / best hand | "
        f"{before} / best hand | tuning s (now, {before}) | epoch check (now, {before}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        now, then = row.get("now", {}), row.get("before", {})

        def chosen(found: dict[str, Any]) -> str:
            return found.get("error") or setting(found["params"]) if found else "-"

        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "-"
        before_ratio = f"{row['before_ratio']:.3f}" if "before_ratio" in row else "-"
        lines.append(
            f"| {row['pipeline']} | {chosen(now)} | {chosen(then)} | {ratio} | {before_ratio} | "
            f"{now.get('seconds', 0):.0f}, {then.get('seconds', 0):.0f} | "
            f"{now.get('epoch', '-')}, {then.get('epoch', '-')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", default=",".join(NAMES))
    parser.add_argument("--time-budget", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--final-rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    default_data = Path(tempfile.gettempdir()) / "autoloader-corpus"
    parser.add_argument("--data", type=Path, default=default_data)
    parser.add_argument("--no-diagnose", dest="diagnose", action="store_false")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--before",
        metavar="REV",
        help="tune with this checkout and with the code at git revision REV, each in a "
        "fresh process (revisions.py), and measure both choices in the same rounds",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    rows = []
    for name in args.pipelines.split(","):
        try:
            rows.append(run_one(build(name, args.data), args))
        except Exception:  # one pipeline's crash must not lose the others' rows
            traceback.print_exc()
    print("\n" + table(rows))
    if args.before:
        print("\n" + before_table(rows, args.before))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()

"""``AutoLoader`` in a real training run: tuning inside the loop against the best hand
setting, ``tune()`` then training, and DataLoader's defaults (issue 27).

For each pipeline (``pipelines.py``: ``images``, JPEG decode and a 20 ms sleeping step
standing in for an accelerator; ``cpu-train-small``, a CNN trained on the CPU beside the
workers):

1. The best hand setting: ``real_pipelines.py``'s hand grid (``num_workers`` 0-4 and 8,
   persistent workers; where the step trains on the CPU, ``num_workers`` 0-4 times the
   training process's torch threads), measured by its ``interleave`` in this process,
   ``--hand-rounds`` rounds of ``--hand-seconds`` each; the grid is printed and its best
   median taken. ``--hand images=3,cpu-train-small=2x1`` names it instead.
2. ``--epochs`` epochs of training under each loader, each run in a fresh Python process
   (imports, worker start-up and torch's threads paid as in a real run):

   - ``defaults``: ``DataLoader(dataset, batch_size, shuffle=True, generator=g)``
     (``--defaults-epochs`` shortens it; compare it by samples/s then);
   - ``best hand``: the setting of step 1;
   - ``tune()+train``: ``autoloader.tune(time_budget=--time-budget)``, then
     ``result.apply_threads()`` and ``result.make_loader(dataset)``;
   - ``AutoLoader first run``: ``AutoLoader(..., path=<a new JSON file>,
     time_budget=--time-budget)``, tuning during its first seconds of training;
   - ``AutoLoader second run``: the same, with the file the first run wrote: it must
     reuse it and tune nothing.

   A run's clock starts before the loader is built (before ``tune()``) and stops at the
   end of its last epoch. Every run collects each epoch's sample ids and checks that each
   epoch held every sample exactly once. The variants run in ``--rounds`` rounds, their
   order rotated each round (the two AutoLoader runs stay together, the second needing
   the first's file); the table shows medians, each variant's time per sample against
   the best hand setting's (its whole-run seconds over the best hand's, for the same
   epochs), and issue 38's targets (first run <= 1.08, second run <= 1.03), printed,
   not asserted.
3. A pipeline whose worker processes from index 2 up are killed (SIGKILL) on their
   first item: ``AutoLoader`` over ``--crash-epochs`` epochs with a
   ``--crash-budget`` budget, in a fresh process; whether the run completed, the chosen
   setting, ``loader.failures``, and each epoch's samples.

    python -W ignore benchmarks/autoloader_training.py [--pipelines images,cpu-train-small]
        [--epochs N] [--defaults-epochs N] [--rounds 2] [--time-budget 20]
        [--hand-rounds 3] [--hand-seconds 4] [--hand images=3,cpu-train-small=2x1]
        [--crash-epochs 8] [--crash-budget 10] [--data /tmp/benchdata] [--json FILE]
        [--before REV]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

import autoloader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipelines import Pipeline, build
from real_pipelines import hand_grid, hand_loader, interleave
from revisions import base, revision_env, run_result_child, setting

PIPELINES = ("images", "cpu-train-small")
# Epochs for a run of the best hand setting of about 40-60 s on the 2-core VM: images
# ~3 s an epoch (2,000 JPEGs at ~700 samples/s), cpu-train-small ~4.5 s (4,000 at ~900).
EPOCHS = {"images": 15, "cpu-train-small": 10}
DEFAULTS, HAND, TUNE, FIRST, SECOND = (
    "defaults",
    "best hand",
    "tune()+train",
    "AutoLoader first run",
    "AutoLoader second run",
)
# The rotation's units: the second AutoLoader run reads the file the first one writes.
UNITS = ((DEFAULTS,), (HAND,), (TUNE,), (FIRST, SECOND))
TARGETS = {FIRST: 1.08, SECOND: 1.03}
# With --before REV, these run again with the autoloader of revision REV (revisions.py),
# named "<variant> @REV", in a unit of their own in the same rotation.
AT_REVISION = (TUNE, FIRST, SECOND)


def units(before: str | None, skip: Iterable[str] = ()) -> list[tuple[str, ...]]:
    """The rotation's units, with those of revision ``before`` where given, less the
    variants named in ``skip`` (``defaults``, ``tune()+train``: the targets need neither)."""
    found = list(UNITS)
    if before:
        found += [(f"{TUNE} @{before}",), (f"{FIRST} @{before}", f"{SECOND} @{before}")]
    return [unit for unit in found if base(unit[0]) not in set(skip)]


RESULT = "RESULT "  # the child's line of figures on stdout


# The crash pipeline ---------------------------------------------------------------------


class DiesFromWorker2(Dataset[tuple[torch.Tensor, int]]):
    """Latency-bound items (``latency`` s each); a worker process with an index of 2 or
    more is killed (SIGKILL, as the kernel's OOM killer does) on its first item. Thread
    workers have no worker index; the pid check keeps the training process alive
    whatever runs the item."""

    def __init__(self, length: int = 1024, latency: float = 0.002) -> None:
        self.length, self.latency = length, latency
        self.training_pid = os.getpid()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        info = get_worker_info()
        if info is not None and info.id >= 2 and os.getpid() != self.training_pid:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.latency)
        return torch.full((64,), float(index)), index


def crash_step(batch: Any) -> None:
    time.sleep(0.004)


def crash_ids(batch: Any) -> list[Any]:
    return [int(i) for i in batch[1]]


# The child: one training run --------------------------------------------------------------


class LogLines(logging.Handler):
    """The ``autoloader`` logger's messages, kept for the child's report."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def epochs_check(
    per_epoch: list[list[Any]], expected: Iterable[Any], batch_size: int, drop_last: bool
) -> str:
    """ "ok" if every epoch held every expected sample once (``drop_last``: the samples of
    its full batches, each once, all expected), else what differed, epoch by epoch."""
    expected = set(expected)
    count = len(expected) // batch_size * batch_size if drop_last else len(expected)
    problems = []
    for number, ids in enumerate(per_epoch):
        counts = collections.Counter(ids)
        repeated = sum(n - 1 for n in counts.values() if n > 1)
        unknown = len(set(counts) - expected)
        lost = count - len(set(counts) & expected)
        if repeated or unknown or lost:
            problems.append(f"epoch {number}: {repeated} repeated, {lost} lost, {unknown} unknown")
    return "; ".join(problems) or "ok"


def train(
    loader: Iterable[Any],
    step: Callable[[Any], object],
    ids: Callable[[Any], list[Any]],
    epochs: int,
    on_batch: Callable[[], None] | None = None,
) -> list[list[Any]]:
    """``epochs`` epochs of ``step`` over ``loader``; each epoch's sample ids."""
    per_epoch = []
    for _ in range(epochs):
        seen: list[Any] = []
        for batch in loader:
            step(batch)
            seen.extend(ids(batch))
            if on_batch is not None:
                on_batch()
        per_epoch.append(seen)
    return per_epoch


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """One variant's training run in this (fresh) process: its figures."""
    log = LogLines()
    logging.getLogger("autoloader").addHandler(log)
    logging.getLogger("autoloader").setLevel(logging.INFO)
    if args.one == "crash":
        pipeline = Pipeline(
            name="crash",
            dataset=DiesFromWorker2(),
            step=crash_step,
            batch_size=16,
            ids=crash_ids,
            expected=list(range(1024)),
            loader_kwargs={"shuffle": True},
        )
    else:
        pipeline = build(args.pipeline, args.data)
    generator = torch.Generator().manual_seed(0)
    fixed = {**pipeline.loader_kwargs, "generator": generator}
    row: dict[str, Any] = {"variant": args.one, "epochs": args.epochs}
    tuned_at: list[float] = []
    started = time.perf_counter()
    loader: Any
    if args.one == DEFAULTS:
        loader = DataLoader(pipeline.dataset, batch_size=pipeline.batch_size, **fixed)
        row["params"] = {"num_workers": 0}
    elif args.one == HAND:
        if args.threads:
            torch.set_num_threads(args.threads)
        pipeline.loader_kwargs = fixed
        loader = hand_loader(pipeline, args.workers)
        row["params"] = {
            "num_workers": args.workers,
            "prefetch_factor": 2 if args.workers else None,
            "persistent_workers": bool(args.workers),
            "step_threads": args.threads,
        }
    elif args.one == TUNE:
        result = autoloader.tune(
            pipeline.dataset,
            pipeline.step,
            batch_size=pipeline.batch_size,
            time_budget=args.time_budget,
            loader_kwargs=fixed,
            show_progress=False,
        )
        tuned_at.append(time.perf_counter() - started)
        result.apply_threads()
        loader = result.make_loader(pipeline.dataset)
        row["params"] = dict(result.params)
    else:  # the AutoLoader runs, and the crash pipeline's
        loader = autoloader.AutoLoader(
            pipeline.dataset,
            batch_size=pipeline.batch_size,
            path=args.path,
            time_budget=args.time_budget,
            **fixed,
        )
    on_batch = None
    if isinstance(loader, autoloader.AutoLoader):

        def on_batch() -> None:
            if not tuned_at and loader.tuned:
                tuned_at.append(time.perf_counter() - started)

    try:
        per_epoch = train(loader, pipeline.step, pipeline.ids, args.epochs, on_batch)
    except Exception as error:  # the crash pipeline's question is whether this happens
        row["error"] = f"{type(error).__name__}: {error}"[:300]
        per_epoch = []
    seconds = time.perf_counter() - started
    samples = sum(len(ids) for ids in per_epoch)
    drop_last = bool(pipeline.loader_kwargs.get("drop_last"))
    row.update(
        seconds=seconds,
        samples=samples,
        samples_per_second=samples / seconds,
        epoch_check=epochs_check(per_epoch, pipeline.expected, pipeline.batch_size, drop_last),
        tuning_seconds=tuned_at[0] if tuned_at else None,
        threads=torch.get_num_threads(),
    )
    if isinstance(loader, autoloader.AutoLoader):
        row["params"] = dict(loader.result.params) if loader.result is not None else None
        row["tuned"] = loader.tuned
        row["trials"] = len(loader.history)
        row["failures"] = loader.failures
        row["reused"] = any(m.startswith("AutoLoader: reusing") for m in log.messages)
    row["log"] = [m for m in log.messages if m.startswith("AutoLoader")]
    return row


# The parent: the grid, the rounds, the tables ----------------------------------------------


def run_child(
    variant: str, args: argparse.Namespace, *options: str, pipeline: str = "", epochs: int = 0
) -> dict[str, Any]:
    """``variant``'s run in a fresh process: its figures, with the process's own seconds
    (start-up and imports included) and the AutoLoader lines it printed. A variant named
    ``"... @REV"`` imports the autoloader of revision REV (``revisions.checkout``)."""
    command = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--one", base(variant)]
    command += ["--pipeline", pipeline, "--epochs", str(epochs), "--data", str(args.data)]
    command += options
    started = time.perf_counter()
    row, why = run_result_child(
        command, marker=RESULT, timeout=args.child_timeout, env=revision_env(variant)
    )
    if row is None:
        return {"variant": variant, "error": why[:400]}
    row["variant"] = variant
    row["process_seconds"] = time.perf_counter() - started
    return row


def best_hand(pipeline: Pipeline, args: argparse.Namespace) -> tuple[int, int | None]:
    """The hand grid's best setting, measured here (``real_pipelines.py``), or the one
    ``--hand`` names: workers, and the training process's threads."""
    named = dict(part.split("=") for part in args.hand.split(",")) if args.hand else {}
    if pipeline.name in named:
        workers, _, threads = named[pipeline.name].partition("x")
        print(f"best hand setting given: {named[pipeline.name]}", flush=True)
        return int(workers), int(threads) if threads else None
    grid = hand_grid(pipeline)
    settings = {name: (lambda w=w: hand_loader(pipeline, w)) for name, (w, _) in grid.items()}
    threads = {name: t for name, (_, t) in grid.items()}
    failures: dict[str, str] = {}
    rates = interleave(
        settings, list(grid), args.hand_rounds, pipeline, args.hand_seconds, failures, threads
    )
    medians = {name: statistics.median(v) for name, v in rates.items() if v}
    print(
        f"hand grid, {args.hand_rounds} interleaved rounds of {args.hand_seconds:g} s "
        "(unique samples/s, median and min-max):"
    )
    for name, values in rates.items():
        if values:
            print(f"  {name:<26} {medians[name]:9,.0f}  ({min(values):,.0f}-{max(values):,.0f})")
    for name, reason in failures.items():
        print(f"  {name:<26} fails: {reason}")
    best = max(medians, key=medians.__getitem__)
    print(f"best hand setting: {best}", flush=True)
    return grid[best]


def chosen(row: dict[str, Any]) -> str:
    """The setting a run trained with, in a few words."""
    if "error" in row:
        return row["error"]
    params = row.get("params")
    if not params:
        return "not tuned by the end of training" if row.get("tuned") is False else "-"
    words = setting(params)
    if params.get("step_threads"):
        words += f", step on {params['step_threads']} thread(s)"
    if row.get("reused"):
        words += " (reused)"
    elif base(row["variant"]) == SECOND:
        words += " (NOT reused: tuned again)"
    return words


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's rounds: medians and ranges."""
    good = [row for row in rows if "error" not in row]
    if not good:
        return {}
    seconds = [row["seconds"] for row in good]
    rates = [row["samples_per_second"] for row in good]
    tuning = [row["tuning_seconds"] for row in good if row.get("tuning_seconds") is not None]
    return {
        "seconds": statistics.median(seconds),
        "seconds_range": (min(seconds), max(seconds)),
        "process_seconds": statistics.median(row["process_seconds"] for row in good),
        "samples_per_second": statistics.median(rates),
        "per_sample": statistics.median(row["seconds"] / row["samples"] for row in good),
        "tuning_seconds": statistics.median(tuning) if tuning else None,
        "epoch_checks": sorted({row["epoch_check"] for row in good}),
    }


def table(name: str, by_variant: dict[str, list[dict[str, Any]]]) -> str:
    """The pipeline's runs, a row a variant (and a row a variant at the revision
    compared with), against the best hand setting."""
    figures = {variant: summary(rows) for variant, rows in by_variant.items()}
    hand = figures.get(HAND, {})
    lines = [
        f"{name}: medians of {max(len(r) for r in by_variant.values())} round(s)",
        "| variant | epochs | whole run s (min-max) | process s | samples/s | / best hand "
        "| target | tuning s | chosen | epoch check |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in by_variant:
        rows, found = by_variant.get(variant, []), figures.get(variant, {})
        if not found:
            error = rows[0]["error"] if rows else "not run"
            lines.append(f"| {variant} | - | - | - | - | - | - | - | {error} | - |")
            continue
        ratio = f"{found['per_sample'] / hand['per_sample']:.3f}" if hand else "-"
        low, high = found["seconds_range"]
        tuning = found["tuning_seconds"]
        settings = sorted({chosen(row) for row in rows})
        lines.append(
            f"| {variant} | {rows[0]['epochs']} | {found['seconds']:.1f} ({low:.1f}-{high:.1f}) "
            f"| {found['process_seconds']:.1f} | {found['samples_per_second']:,.0f} | {ratio} "
            f"| {'<= ' + format(TARGETS[base(variant)]) if base(variant) in TARGETS else ''} "
            f"| {'-' if tuning is None else format(tuning, '.1f')} | {'; '.join(settings)} "
            f"| {', '.join(found['epoch_checks'])} |"
        )
    return "\n".join(lines)


def run_pipeline(name: str, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    pipeline = build(name, args.data)
    epochs = args.epochs or EPOCHS.get(name, 10)
    print(
        f"\n== {name}: {pipeline.what}; {len(pipeline.expected)} samples, batch "
        f"{pipeline.batch_size}, {epochs} epochs",
        flush=True,
    )
    workers, threads = best_hand(pipeline, args)
    del pipeline  # the children build their own
    options = {
        HAND: ["--workers", str(workers), "--threads", str(threads or 0)],
        TUNE: ["--time-budget", str(args.time_budget)],
    }
    rotation = units(args.before, [name for name in args.skip.split(",") if name])
    by_variant: dict[str, list[dict[str, Any]]] = {v: [] for unit in rotation for v in unit}
    for round_number in range(args.rounds):
        shift = round_number % len(rotation)
        folder = Path(tempfile.mkdtemp(prefix="autoloader-training-"))
        try:
            for unit in rotation[shift:] + rotation[:shift]:
                for variant in unit:
                    extra = options.get(base(variant), [])
                    if base(variant) in (FIRST, SECOND):
                        extra = ["--time-budget", str(args.time_budget)]
                        file = "autoloader.json" if variant == base(variant) else "before.json"
                        extra += ["--path", str(folder / file)]
                    count = args.defaults_epochs or epochs if variant == DEFAULTS else epochs
                    row = run_child(variant, args, *extra, pipeline=name, epochs=count)
                    by_variant[variant].append(row)
                    say(round_number, row)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print("\n" + table(name, by_variant), flush=True)
    print(paired(by_variant), flush=True)
    return by_variant


def paired(by_variant: dict[str, list[dict[str, Any]]]) -> str:
    """Each variant's time per sample over the best hand run's of the same round, the
    median and each round's: the machine's pace drifts by 10-30% over an hour here, and a
    ratio of medians taken from different rounds carries that drift; a ratio within a
    round, minutes apart, carries less of it."""
    hand = by_variant.get(HAND, [])
    lines = ["Per round, over the same round's best hand run (median; each round's):"]
    for variant, rows in by_variant.items():
        if variant == HAND:
            continue
        ratios = [
            row["seconds"] / row["samples"] / (mate["seconds"] / mate["samples"])
            for row, mate in zip(rows, hand, strict=True)
            if "error" not in row and "error" not in mate
        ]
        if not ratios:
            continue
        target = TARGETS.get(base(variant))
        lines.append(
            f"  {variant:<26} {statistics.median(ratios):.3f}"
            + (f" (target <= {target:g})" if target is not None else "")
            + f"; {', '.join(format(r, '.3f') for r in ratios)}"
        )
    return "\n".join(lines)


def say(round_number: int, row: dict[str, Any]) -> None:
    """One run's line as it ends."""
    if "error" in row:
        print(f"  round {round_number + 1} {row['variant']:<22} error: {row['error']}", flush=True)
        return
    print(
        f"  round {round_number + 1} {row['variant']:<22} {row['seconds']:6.1f} s "
        f"({row['process_seconds']:.1f} s in all), {row['samples_per_second']:6,.0f} samples/s, "
        f"{chosen(row)}; epochs {row['epoch_check']}",
        flush=True,
    )
    for line in row.get("log", []):
        print(f"      {line}", flush=True)


def run_crash(args: argparse.Namespace) -> dict[str, Any]:
    print(
        f"\n== crash: worker processes from index 2 up killed (SIGKILL) on their first item; "
        f"AutoLoader, {args.crash_epochs} epochs, {args.crash_budget:g} s budget",
        flush=True,
    )
    row = run_child(
        "crash",
        args,
        "--time-budget",
        str(args.crash_budget),
        pipeline="crash",
        epochs=args.crash_epochs,
    )
    if "error" in row and "seconds" not in row:
        print(f"the run's process failed: {row['error']}")
        return row
    print(f"completed: {'no: ' + row['error'] if 'error' in row else 'yes'}")
    print(f"whole run: {row['seconds']:.1f} s, {row['samples_per_second']:,.0f} samples/s")
    tuning = row.get("tuning_seconds")
    print(
        f"tuned: {row.get('tuned')} ({row.get('trials')} trials"
        + (f", chosen after {tuning:.1f} s)" if tuning is not None else ")")
    )
    print(f"chosen: {chosen(row)}")
    print(f"loader.failures ({len(row.get('failures') or [])}):")
    for failure in row.get("failures") or []:
        print(f"  - {failure}")
    print(f"every epoch every sample once: {row['epoch_check']}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--epochs", type=int, default=0, help="0: per pipeline, see EPOCHS")
    parser.add_argument("--defaults-epochs", type=int, default=0, help="0: as --epochs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--time-budget", type=float, default=20.0)
    parser.add_argument("--hand-rounds", type=int, default=3)
    parser.add_argument("--hand-seconds", type=float, default=4.0)
    parser.add_argument("--hand", default="", help="e.g. images=3,cpu-train-small=2x1")
    parser.add_argument("--crash-epochs", type=int, default=8)
    parser.add_argument("--crash-budget", type=float, default=10.0)
    parser.add_argument("--no-crash", dest="crash", action="store_false")
    parser.add_argument(
        "--skip",
        default="",
        help=f"variants left out, e.g. '{DEFAULTS},{TUNE}' (the targets need neither)",
    )
    parser.add_argument("--data", type=Path, default=Path("/tmp/benchdata"))
    parser.add_argument("--child-timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--before",
        metavar="REV",
        help="also run tune()+train and the two AutoLoader runs with the code at git "
        "revision REV, in the same rotation (each in a fresh process; revisions.py)",
    )
    # One run in this process (the parent starts these).
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", handlers=[handler])
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    if args.one:
        print(RESULT + json.dumps(one_run(args), default=str), flush=True)
        return
    print(
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"time budget {args.time_budget:g} s, {args.rounds} round(s)",
        flush=True,
    )
    found: dict[str, Any] = {}
    for name in args.pipelines.split(","):
        found[name] = run_pipeline(name, args)
    if args.crash:
        found["crash"] = run_crash(args)
    if args.json:
        args.json.write_text(json.dumps(found, indent=2, default=str))


if __name__ == "__main__":
    main()

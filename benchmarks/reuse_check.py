"""A saved result reused, checked by measurement before it is trusted (issue 39): what the
check costs where nothing changed, and that it tunes again where the storage slowed.

The figures: "A saved result reused after the dataset slowed 20x: re-tuned; reused
after no change: the check costs <= 2% of the budget."

The pipeline is ``pipelines.py``'s ``images`` (JPEG files decoded with PIL, torch-op
augmentation, a 20 ms step standing in for an accelerator), read through
``drift.py``'s ``SlowingStorage``: each item waits ``--latency`` seconds (1 ms, a local
disk), or 20 times that once a file the workers see exists (a cold cache, a remote
filesystem). The problem's description (types, length, batch size, space, machine,
code) is the same either way: only a measurement can tell the two apart.

For each entry point, three runs, each in a fresh process (a user's next job), sharing
one result file:

1. ``first``: no file yet; tunes with ``--time-budget`` and saves.
2. ``same``: nothing changed; the file is reused, after its check.
3. ``slowed``: the storage is 20x slower; the check must find it and tune again.

- ``tune()``: each run is one ``tune(path=...)`` call, timed whole. The check is one
  short trial of the saved setting (``NOTE [ A reused setting checked ]``); its cost is
  the reusing call's seconds, set against the budget.
- ``AutoLoader``: each run trains ``--epochs`` epochs (the first run until tuned and
  then ``--epochs`` more). The check times the first batches the reused setting loads,
  the training's own: its cost is what a run reusing the file pays over DataLoader built
  with the same setting, run in the same process, epoch for epoch, interleaved (the
  AutoLoader's epoch, then DataLoader's, ``--epochs`` times).

Every epoch's samples are checked (each once, none lost).

    python -W ignore benchmarks/reuse_check.py [--time-budget 20] [--latency 0.001]
        [--slower 20] [--epochs 6] [--entries tune,autoloader] [--data /tmp/benchdata]
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
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drift import SlowingStorage
from pipelines import Pipeline, build, train_epoch
from real_pipelines import tuned_loader
from revisions import run_result_child, setting

RESULT = "reuse-result: "
RUNS = ("first", "same", "slowed")


class _Lines(logging.Handler):
    """The autoloader log's lines and their levels."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _pipeline(args: argparse.Namespace, switch: str) -> Pipeline:
    """The ``images`` pipeline behind storage of ``--latency`` s an item, ``--slower``
    times that once ``switch`` exists."""
    pipeline = build("images", args.data)
    dataset = SlowingStorage(pipeline.dataset, args.latency, args.latency * args.slower, switch)
    return Pipeline(
        name=pipeline.name, dataset=dataset, step=pipeline.step,
        batch_size=pipeline.batch_size, ids=pipeline.ids, expected=pipeline.expected,
        loader_kwargs=pipeline.loader_kwargs,
    )  # fmt: skip


def _epoch(loader: Any, pipeline: Pipeline) -> tuple[float, str]:
    """One epoch of training: its seconds, and "ok" or how its samples differ."""
    seconds, _, check = train_epoch(loader, pipeline)
    return seconds, check


def _reuse_said(lines: list[tuple[str, str]]) -> str:
    """What the log said of the file: reused after its check, or not, and why."""
    for level, message in lines:
        if "not reusing" in message:
            return f"{level}: {message}"
    for level, message in lines:
        if "checked before reuse" in message or "reusing" in message:
            return f"{level}: {message}"
    return "no reuse"


def run_tune(args: argparse.Namespace, pipeline: Pipeline, path: str) -> dict[str, Any]:
    # Imported before the clock starts: autoloader imports its modules as they are first
    # used, and tune()'s own import (0.23 s here) is no part of the reusing call's cost.
    from autoloader import tune

    started = time.perf_counter()
    result = tune(
        pipeline.dataset, pipeline.step, batch_size=pipeline.batch_size,
        time_budget=args.time_budget, loader_kwargs=pipeline.loader_kwargs, path=path,
        show_progress=False,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    _, check = _epoch(result.make_loader(pipeline.dataset), pipeline)
    return {
        "seconds": seconds,
        "params": dict(result.params),
        "notes": [n for n in result.notes if "checked before reuse" in n],
        "epochs_check": [check],
    }


def run_autoloader(args: argparse.Namespace, pipeline: Pipeline, path: str) -> dict[str, Any]:
    from autoloader import AutoLoader

    loader = AutoLoader(
        pipeline.dataset, batch_size=pipeline.batch_size, time_budget=args.time_budget,
        path=path, generator=torch.Generator().manual_seed(0), verbose=False,
        **pipeline.loader_kwargs,
    )  # fmt: skip
    row: dict[str, Any] = {"epochs_check": []}
    started = time.perf_counter()
    while args.one == "first" and not loader.tuned:
        row["epochs_check"].append(_epoch(loader, pipeline)[1])
    row["tuned_after"] = time.perf_counter() - started if args.one == "first" else None
    ours: list[float] = []
    for _ in range(args.epochs):
        seconds, check = _epoch(loader, pipeline)
        ours.append(seconds)
        row["epochs_check"].append(check)
    row["seconds"] = sum(ours)
    row["params"] = dict(loader.result.params) if loader.result is not None else None
    loader.close()
    if args.one == "same" and row["params"] is not None:
        # The same setting in DataLoader, epoch for epoch, interleaved with AutoLoader's.
        row["autoloader_epochs"], row["dataloader_epochs"] = [], []
        again = AutoLoader(
            pipeline.dataset, batch_size=pipeline.batch_size, time_budget=args.time_budget,
            path=path, generator=torch.Generator().manual_seed(0), verbose=False,
            **pipeline.loader_kwargs,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            plain = tuned_loader(pipeline, row["params"])
            for _ in range(args.epochs):
                seconds, check = _epoch(again, pipeline)
                row["autoloader_epochs"].append(seconds)
                row["epochs_check"].append(check)
                seconds, check = _epoch(plain, pipeline)
                row["dataloader_epochs"].append(seconds)
                row["epochs_check"].append(check)
        again.close()
        del plain
    return row


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One run (``--one``) of one entry point (``--entry``), in this fresh process."""
    lines = _Lines()
    logging.getLogger("autoloader").addHandler(lines)
    logging.getLogger("autoloader").setLevel(logging.INFO)
    switch = os.path.join(args.folder, "slow")
    if args.one == "slowed":
        Path(switch).touch()
    pipeline = _pipeline(args, switch)
    path = os.path.join(args.folder, f"{args.entry}.json")
    run = run_tune if args.entry == "tune" else run_autoloader
    row = run(args, pipeline, path)
    row.update(entry=args.entry, run=args.one, reuse=_reuse_said(lines.lines))
    row["trials_here"] = sum(1 for _, message in lines.lines if message.startswith("trial "))
    row["warnings"] = [m for level, m in lines.lines if level == "WARNING"]
    row["probe"] = [m for _, m in lines.lines if "the defaults' loop does not settle" in m]
    return row


# The parent -------------------------------------------------------------------------------


def run_child(args: argparse.Namespace, entry: str, one: str, folder: str) -> dict[str, Any]:
    here = os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--one", one]
    command += ["--entry", entry, "--folder", folder, "--data", str(args.data)]
    for name in ("time_budget", "latency", "slower", "epochs"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here])}
    row, why = run_result_child(
        command, marker=RESULT, timeout=args.time_budget * 10 + 600, env=env
    )
    if row is None:
        raise SystemExit(f"the {entry} {one} run failed: {why}")
    return row


def describe(row: dict[str, Any], budget: float) -> None:
    checks = collections.Counter(row["epochs_check"])
    chosen = setting(row["params"]) if row["params"] else "none"
    print(
        f"  {row['entry']:<10} {row['run']:<7} {row['seconds']:6.1f} s, "
        f"{row['trials_here']} trials run here, chosen: {chosen}; epochs: {dict(checks)}"
    )
    print(f"             {row['reuse'][:200]}")
    if row["entry"] == "tune" and row["run"] == "same":
        print(
            f"             the reusing call: {row['seconds']:.2f} s, "
            f"{row['seconds'] / budget:.1%} of the {budget:g} s budget (target <= 2%)"
        )
        for line in row.get("probe", []):
            print(f"             {line.split(': ', 1)[1]}")
        for note in row.get("notes", []):
            if note.startswith("checked before reuse"):
                print(f"             the check: {note.removeprefix('checked before reuse')[1:]}")
    if "autoloader_epochs" in row:
        ours, theirs = sum(row["autoloader_epochs"]), sum(row["dataloader_epochs"])
        print(
            f"             {len(row['autoloader_epochs'])} epochs interleaved: AutoLoader "
            f"reusing the file {ours:.1f} s, DataLoader with its setting {theirs:.1f} s: "
            f"{ours / theirs:.3f} (the check's cost: {(ours - theirs) / budget:+.1%} of the "
            "budget); per epoch "
            f"{statistics.median(row['autoloader_epochs']):.2f} s against "
            f"{statistics.median(row['dataloader_epochs']):.2f} s"
        )
    if row["run"] == "slowed":
        tuned_again = row["trials_here"] > 0
        print(f"             tuned again: {'yes' if tuned_again else 'NO'} (target: yes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-budget", type=float, default=20.0)
    parser.add_argument("--latency", type=float, default=0.001, help="seconds an item waits")
    parser.add_argument("--slower", type=float, default=20.0, help="how much slower, slowed")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--entries", default="tune,autoloader")
    parser.add_argument("--data", type=Path, default=Path("/tmp/benchdata"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--entry", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(RESULT + json.dumps(run_one(args)), flush=True)
        return
    print(
        f"{os.cpu_count()} CPUs, torch {torch.__version__}; images behind storage of "
        f"{args.latency:g} s an item, {args.slower:g}x that slowed; time budget "
        f"{args.time_budget:g} s"
    )
    rows = []
    for entry in args.entries.split(","):
        folder = tempfile.mkdtemp(prefix=f"reuse-{entry}-")
        for one in RUNS:
            row = run_child(args, entry, one, folder)
            describe(row, args.time_budget)
            rows.append(row)
    if args.json:
        arguments = {k: str(v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": arguments, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

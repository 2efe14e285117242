"""``AutoLoader`` when loading drifts mid-training (issue 39): the search the watch starts
again, against the best hand setting for the new speed; and a run with no change, which
must never search again.

The pipeline is ``pipelines.py``'s ``images`` (JPEG files decoded with PIL, torch-op
augmentation, a 20 ms step standing in for an accelerator), read through storage whose
per-item latency grows ``--latency`` (1 ms to 6 ms: a cold cache, a remote filesystem, a
noisy neighbour on the disk). The latency is a sleep, holding no CPU, as a wait on the
network holds none; the decode is real.

1. ``change``, in a fresh process per revision: ``AutoLoader(time_budget=--time-budget)``
   trains until tuned, ``--settle`` epochs more, then the storage slows (a file the
   workers see appears); it trains until the watch has searched again and is tuned, then
   ``--after`` epochs. Every epoch's samples are checked (each once, none lost), and its
   rate and phase are kept; the seconds from the change to the search's start and end.
2. The grid at the new speed, in this process, interleaved: ``--rounds`` rounds of
   ``--seconds`` each (``real_pipelines.training_rate``: the start-up burst drained,
   epoch restarts on the clock), rotated each round, of DataLoader with persistent
   workers at ``--hand`` counts (what a patient person tries for slow storage), the
   setting each revision chose before the change, and the one it chose after. The
   figure: the setting chosen after the change over the best hand setting, side by side
   (the issue's target, >= 0.8), and the epochs after the search in the run itself.
3. ``steady`` (``--steady``), in a fresh process: no change. ``AutoLoader`` trains until
   tuned, then until its watch counts (the gap after a search), then ``--steady-epochs``
   epochs of ordinary noise; with ``--neighbour``, a process beside it keeps a core busy
   1 s of every 8 (a neighbour's bursts). The figure: searches started (the target: none).

    python -W ignore benchmarks/drift.py [--time-budget 20] [--latency 0.001,0.006]
        [--settle 3] [--after 8] [--rounds 3] [--seconds 4] [--hand 2,4,8,12,16]
        [--steady] [--steady-epochs 30] [--neighbour] [--before REV] [--data /tmp/benchdata]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipelines import Pipeline, build, train_epoch
from real_pipelines import hand_loader, interleave, tuned_loader
from revisions import checkout, run_result_child, setting

RESULT = "drift-result: "
# A neighbour's bursts (--neighbour): one core busy this long, then idle this long.
BURST, QUIET = 1.0, 7.0


class SlowingStorage(Dataset[Any]):
    """``dataset`` read through storage with a per-item latency of ``fast`` seconds, or
    ``slow`` once the file ``switch`` exists (worker processes see it appear)."""

    def __init__(self, dataset: Dataset[Any], fast: float, slow: float, switch: str) -> None:
        self.dataset, self.fast, self.slow, self.switch = dataset, fast, slow, switch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.slow if os.path.exists(self.switch) else self.fast)
        return self.dataset[index]


def slowing(args: argparse.Namespace, switch: str) -> Pipeline:
    """The ``images`` pipeline behind :class:`SlowingStorage`."""
    fast, slow = (float(part) for part in args.latency.split(","))
    pipeline = build("images", args.data)
    dataset = SlowingStorage(pipeline.dataset, fast, slow, switch)
    return dataclasses.replace(pipeline, dataset=dataset)


# One AutoLoader run, in a process of its own ----------------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.perf_counter(), record.getMessage()))


def _epoch(loader: DataLoader[Any], pipeline: Pipeline) -> tuple[float, str]:
    """One epoch of training: its samples/s, and "ok" or how its samples differ."""
    seconds, samples, check = train_epoch(loader, pipeline)
    return samples / seconds, check


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """The AutoLoader run of ``args.one`` (``change`` or ``steady``): its epochs, what it
    chose, and when."""
    from autoloader import AutoLoader  # the revision's, by PYTHONPATH

    lines = _Lines()
    logging.getLogger("autoloader").addHandler(lines)
    logging.getLogger("autoloader").setLevel(logging.INFO)
    folder = tempfile.mkdtemp(prefix="drift-")
    switch = os.path.join(folder, "slow")
    pipeline = slowing(args, switch)
    loader = AutoLoader(
        pipeline.dataset,
        batch_size=pipeline.batch_size,
        time_budget=args.time_budget,
        path=os.path.join(folder, "result.json"),
        generator=torch.Generator().manual_seed(0),
        verbose=False,
        **pipeline.loader_kwargs,
    )
    epochs: list[dict[str, Any]] = []
    started = time.perf_counter()

    def train(phase: str) -> None:
        rate, check = _epoch(loader, pipeline)
        epochs.append({"phase": phase, "rate": rate, "check": check, "at": _since(started)})

    row: dict[str, Any] = {"revision": args.revision}
    while not loader.tuned:
        train("tuning")
    row["tuned_at"] = _since(started)
    row["before"] = dict(loader.result.params)  # type: ignore[union-attr]
    if args.one == "change":
        for _ in range(args.settle):
            train("before")
        Path(switch).touch()
        row["changed_at"] = _since(started)
        while (loader.tuning.researches == 0 or not loader.tuned) and (  # type: ignore[union-attr]
            _since(started) - row["changed_at"] < args.most_seconds
        ):
            train("drifted" if loader.tuning.researches == 0 else "searching")  # type: ignore[union-attr]
        row["searched_again_at"] = _since(started)
        row["after"] = dict(loader.result.params)  # type: ignore[union-attr]
        for _ in range(args.after):
            train("after")
    else:
        watch = loader.tuning.drift  # type: ignore[union-attr]
        row["watched"] = watch is not None
        while watch is not None and time.perf_counter() < watch.counts_from:
            train("gap")
        most = 0
        for _ in range(args.steady_epochs):
            train("steady")
            now = loader.tuning.drift  # type: ignore[union-attr]
            most = max(most, now.drifted if now is not None else 0)
        row["most_drifted_windows_in_a_row"] = most
    row["researches"] = loader.tuning.researches  # type: ignore[union-attr]
    loader.close()
    row["epochs"] = epochs
    row["log"] = [
        f"{at - started:6.1f} s  {message}"
        for at, message in lines.lines
        if "drift" in message or "searched again" in message or "tuned in" in message
    ]
    return row


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 2)


# The parent -------------------------------------------------------------------------------


def run_child(args: argparse.Namespace, one: str, revision: str | None) -> dict[str, Any]:
    """``one``'s run in a fresh process, with ``revision``'s autoloader (``None``: this
    checkout's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--one", one]
    command += ["--revision", revision or "now"]
    for name in ("time_budget", "latency", "settle", "after", "steady_epochs", "most_seconds"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--data", str(args.data)]
    code = str(checkout(revision)) if revision else os.path.dirname(here)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([code, here])}
    row, why = run_result_child(
        command, marker=RESULT, timeout=args.most_seconds * 3 + 600, env=env
    )
    if row is None:
        raise SystemExit(f"the {one} run of {revision or 'now'} failed: {why}")
    return row


def _median(epochs: list[dict[str, Any]], phase: str) -> float | None:
    rates = [e["rate"] for e in epochs if e["phase"] == phase]
    return statistics.median(rates) if rates else None


def describe_run(row: dict[str, Any]) -> None:
    checks = collections.Counter(e["check"] for e in row["epochs"])
    phases = collections.Counter(e["phase"] for e in row["epochs"])
    print(f"\n-- {row['revision']}: tuned at {row['tuned_at']:.1f} s: {setting(row['before'])}")
    for line in row["log"]:
        print(f"   {line}")
    if "changed_at" in row:
        print(
            f"   changed at {row['changed_at']:.1f} s; searched again and tuned "
            f"{row['searched_again_at'] - row['changed_at']:.1f} s after the change: "
            f"{setting(row['after'])}"
        )
    print(f"   epochs by phase: {dict(phases)}; samples: {dict(checks)}")
    for phase in ("before", "drifted", "searching", "after", "gap", "steady"):
        rate = _median(row["epochs"], phase)
        if rate is not None:
            print(f"   {phase:<9} median {rate:7.0f} samples/s over {phases[phase]} epochs")


def grid(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Every setting at the new speed, interleaved: the hand grid and what each run chose
    before and after the change."""
    folder = tempfile.mkdtemp(prefix="drift-grid-")
    switch = os.path.join(folder, "slow")
    Path(switch).touch()
    pipeline = slowing(args, switch)
    settings: dict[str, Any] = {}
    for workers in (int(n) for n in args.hand.split(",")):
        settings[f"hand: {workers} persistent"] = lambda w=workers: hand_loader(pipeline, w)
    for run in runs:
        for when in ("before", "after"):
            name = f"{run['revision']} {when}: {setting(run[when])}"
            settings[name] = lambda p=run[when]: tuned_loader(pipeline, p)
    failures: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        rates = interleave(settings, list(settings), args.rounds, pipeline, args.seconds, failures)
    for name, error in failures.items():
        print(f"   {name}: failed: {error}")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time-budget", type=float, default=20.0)
    parser.add_argument("--latency", default="0.001,0.006", help="seconds an item, before,after")
    parser.add_argument("--settle", type=int, default=3)
    parser.add_argument("--after", type=int, default=8)
    parser.add_argument("--most-seconds", type=float, default=400.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--hand", default="2,4,8,12,16")
    parser.add_argument("--steady", action="store_true")
    parser.add_argument("--steady-epochs", type=int, default=30)
    parser.add_argument("--neighbour", action="store_true")
    parser.add_argument("--before", default=None, metavar="REV")
    parser.add_argument("--data", type=Path, default=Path("/tmp/benchdata"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--revision", default="now", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(RESULT + json.dumps(run_one(args)), flush=True)
        return
    print(
        f"{os.cpu_count()} CPUs, torch {torch.__version__}; images behind storage of "
        f"{args.latency} s an item; time budget {args.time_budget:g} s"
    )
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.steady:
        neighbour = _neighbour() if args.neighbour else None
        try:
            row = run_child(args, "steady", None)
        finally:
            if neighbour is not None:
                os.killpg(neighbour.pid, signal.SIGKILL)
                neighbour.wait()
        describe_run(row)
        print(
            f"\nno change, {args.steady_epochs} epochs past the gap"
            f"{' beside a bursty neighbour' if args.neighbour else ''}: "
            f"{row['researches']} searches started (target 0); at most "
            f"{row['most_drifted_windows_in_a_row']} drifted windows in a row"
        )
        report["steady"] = row
    else:
        revisions = [None, args.before] if args.before else [None]
        runs = [run_child(args, "change", revision) for revision in revisions]
        for run in runs:
            describe_run(run)
        print(f"\n== at the new speed, interleaved: {args.rounds} rounds of {args.seconds:g} s")
        rates = grid(args, runs)
        medians = {name: statistics.median(r) for name, r in rates.items() if r}
        best_name = max((n for n in medians if n.startswith("hand")), key=medians.__getitem__)
        best = medians[best_name]
        for name, rate in medians.items():
            spread = f"{min(rates[name]):.0f}-{max(rates[name]):.0f}"
            print(f"   {name:<58} {rate:7.0f} samples/s ({spread})  {rate / best:.2f}")
        for run in runs:
            after = _median(run["epochs"], "after")
            side = medians.get(f"{run['revision']} after: {setting(run['after'])}")
            print(
                f"{run['revision']}: the setting chosen after the change, side by side: "
                f"{side / best if side else float('nan'):.2f} of the best hand setting "
                f"({best_name}); in the run, the epochs after the search: "
                f"{after / best if after else float('nan'):.2f} (target >= 0.8)"
            )
        report.update(runs=runs, rates=rates, best=best_name)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def _neighbour() -> subprocess.Popen[bytes]:
    """A process keeping one core busy ``BURST`` seconds of every ``BURST + QUIET``."""
    code = (
        "import time\nwhile True:\n    t = time.perf_counter()\n"
        f"    while time.perf_counter() - t < {BURST}: pass\n    time.sleep({QUIET})\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


if __name__ == "__main__":
    main()

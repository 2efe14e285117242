"""``AutoLoader`` in a Lightning DDP fit whose epochs are 12 batches a rank, against the
best hand setting and DataLoader's defaults (issue 38).

The figure: "The 12-batch-epoch DDP fit: AutoLoader reaches >= 0.9 of the best hand
setting's whole-run rate." Before trials spanned epochs, every trial with workers ended
with its epoch and was pruned "too short" (8 workers x prefetch 2 hold 16 batches, more
than the epoch's 12), and AutoLoader kept ``num_workers=0``: 1.00x, where 8 persistent
workers gave 3.08x (``NOTE [ Live trials span epochs ]``, in ``autoloader/measure/_live.py``).

The fit: ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``, no logger, no
checkpointing, no progress bar; a small MLP (``frameworks.py``'s ``Regressor``) stepping
on the CPU, 1 torch thread a rank (Lightning's share of the 2 cores); 768 items that
each wait ``--latency`` seconds (a read from remote storage, ``frameworks.py``'s
``RemoteItems``, with its index), batches of 32, Lightning's DistributedSampler giving
each rank 384 items (nothing padded): 12 batches a rank an epoch. Each run trains
``--epochs`` epochs (by default 3x ``--time-budget`` of the best hand setting's epochs,
estimated at 0.3 s each on the 2-core VM: 100) with one train loader, given to
``trainer.fit``:

- ``defaults``: ``DataLoader(dataset, batch_size=32, shuffle=True)`` (``num_workers=0``);
- ``hand N`` for each N of ``--hand`` (2, 4, 8): the same with ``num_workers=N`` and
  ``persistent_workers=True``;
- ``AutoLoader first run``: ``AutoLoader(dataset, batch_size=32, shuffle=True,
  time_budget=--time-budget, path=<a new JSON file>)``, tuning inside the fit (Lightning
  rebuilds it with its DistributedSampler: a copy that loads through its tuning);
- ``AutoLoader second run``: the same, with the file the first run wrote.

Every run is a fresh pair of Python processes, the two ranks, started as Lightning's own
launcher starts its second rank (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``) but both by this script, each in a session of its own,
killed with its workers past ``--child-timeout``; a run that leaves a process behind
says so. Once both ranks have imported and built their model and Trainer, rank 0's
clock starts: before the loader is built and ``trainer.fit`` is called, stopped when it
returns (process group, DDP, worker start-up, tuning, every epoch's end and refill
included). Each rank records the sample ids of each of its epochs; after the fit rank 0
gathers them (``all_gather_object``) and checks that every epoch trained on every sample
exactly once across the ranks. For AutoLoader, rank 0 reports the chosen setting
(``loader.result.params`` of the loader it built; rank 1's is compared with it), the
setting that loaded the last batch (``.setting`` of the loader Lightning trains with)
and when tuning ended.

The variants run in ``--rounds`` rounds, their order rotated each round (the two
AutoLoader runs stay together, the second needing the first's file); the table shows
medians of the whole-run seconds and samples per second (both ranks' samples), and each
variant's rate over the best hand setting's (the hand setting of the highest median
rate); the target (first run >= 0.9) is printed, not asserted.

    python -W ignore benchmarks/ddp_short_epochs.py [--time-budget 10] [--epochs N]
        [--rounds 3] [--hand 2,4,8] [--latency 0.003]
        [--variants defaults,hand,first,second] [--before REV] [--child-timeout 900]
        [--json FILE]

With ``--before REV``, the AutoLoader runs also run with the autoloader of revision REV
(``revisions.checkout``), in the same rounds, after this checkout's.

With the defaults, about 20 minutes on the 2-core VM: a round is six runs, the defaults'
about 130 s, and each run's two ranks take 10-15 s to start, off the clock.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import autoloader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from frameworks import Regressor, RemoteItems
from revisions import base, revision_env, setting

RANKS = 2
BATCH_SIZE = 32
BATCHES_PER_RANK = 12
# Divisible by the ranks: DistributedSampler pads nothing, each epoch is every item once.
LENGTH = BATCHES_PER_RANK * BATCH_SIZE * RANKS
TARGET = 0.9  # AutoLoader's first run over the best hand setting, in samples/s
# The best hand setting's epoch on the 2-core VM (8 persistent workers, 3 ms items), an
# estimate still to check against a full run: 12 batches at ~12 ms once the workers run
# (32 x 3 ms over 8), the refill after each epoch's end (~0.1 s, a worker's first batch)
# and Lightning's own work between epochs. The default --epochs is 3x the time budget of
# these.
BEST_EPOCH_SECONDS = 0.3
DEFAULTS, FIRST, SECOND = "defaults", "AutoLoader first run", "AutoLoader second run"
RESULT = "result.json"  # rank 0's figures, in the run's folder


def hand(workers: int) -> str:
    return f"hand {workers}"


def hand_workers(variant: str) -> int | None:
    """The workers of a hand variant, ``None`` for another."""
    name, _, workers = variant.partition(" ")
    return int(workers) if name == "hand" else None


# One rank of one run -----------------------------------------------------------------------


class IndexedItems(Dataset[dict[str, torch.Tensor]]):
    """``RemoteItems``' items (each waits ``latency`` s), with each item's index."""

    def __init__(self, length: int, latency: float) -> None:
        self.items = RemoteItems(length, latency)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item: dict[str, torch.Tensor] = self.items[index]
        item["index"] = torch.tensor(index)
        return item


class Fit(pl.LightningModule):
    """The small model, recording the sample ids of each epoch it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Regressor()
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(self.current_epoch, []).extend(batch["index"].tolist())
        loss: torch.Tensor = self.model(batch["x"], batch["y"])["loss"]
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Watch(pl.Callback):
    """After each batch: when the AutoLoader's tuning ended, on the run's clock, and the
    setting that loaded the batch, as the loader Lightning trains with (its rebuild with
    a DistributedSampler) and the one the script built report it."""

    def __init__(self) -> None:
        self.started = 0.0
        self.held: Any = None  # the loader the script built and gave to fit
        self.tuned_at: float | None = None
        self.used: dict[str, Any] | None = None
        self.held_setting: dict[str, Any] | None = None
        self.switches = 0

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        used = trainer.train_dataloader
        if not isinstance(used, autoloader.AutoLoader):
            return
        if self.tuned_at is None and used.tuned:
            self.tuned_at = time.perf_counter() - self.started
        current = used.setting
        if current != self.used:
            self.switches += 1
            self.used = current
        self.held_setting = self.held.setting


class LogLines(logging.Handler):
    """The ``autoloader`` logger's messages, kept for the run's report."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def rendezvous(folder: Path, rank: int, timeout: float = 300.0) -> None:
    """Wait until every rank is here (their imports done, their Trainer built): the clock
    then leaves out how long each rank took to start."""
    (folder / f"ready{rank}").touch()
    give_up = time.monotonic() + timeout
    while not all((folder / f"ready{r}").exists() for r in range(RANKS)):
        if time.monotonic() > give_up:
            raise TimeoutError(f"rank {rank}: the other ranks did not start in {timeout:g} s")
        time.sleep(0.01)


def build_loader(variant: str, dataset: IndexedItems, args: argparse.Namespace) -> Any:
    """The variant's train loader, as a user would write it."""
    if variant == DEFAULTS:
        return DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True)
    workers = hand_workers(variant)
    if workers is not None:
        return DataLoader(
            dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=workers,
            persistent_workers=True,
        )  # fmt: skip
    return autoloader.AutoLoader(
        dataset, batch_size=BATCH_SIZE, shuffle=True, time_budget=args.time_budget,
        path=args.path,
    )  # fmt: skip


def params_of(variant: str, loader: Any) -> dict[str, Any] | None:
    """The setting the run trained with: its own, or the tuned one (``None`` where
    tuning had not ended)."""
    if isinstance(loader, autoloader.AutoLoader):
        result: autoloader.TuneResult | None = loader.result
        return None if result is None else dict(result.params)
    workers = hand_workers(variant) or 0
    return {
        "num_workers": workers,
        "prefetch_factor": 2 if workers else None,
        "persistent_workers": bool(workers),
    }


def epochs_check(per_rank: list[dict[int, list[int]]], epochs: int) -> str:
    """ "ok" if every epoch trained on every sample exactly once across the ranks, else
    what differed, epoch by epoch."""
    problems = []
    expected = set(range(LENGTH))
    for epoch in range(epochs):
        counts = collections.Counter(i for seen in per_rank for i in seen.get(epoch, []))
        repeated = sum(n - 1 for n in counts.values() if n > 1)
        unknown = len(set(counts) - expected)
        lost = len(expected - set(counts))
        if repeated or unknown or lost:
            problems.append(f"epoch {epoch}: {repeated} repeated, {lost} lost, {unknown} unknown")
    extra = sorted({e for seen in per_rank for e in seen if not 0 <= e < epochs})
    if extra:
        problems.append(f"epochs past the last: {extra}")
    return "; ".join(problems) or "ok"


def one_rank(args: argparse.Namespace) -> None:
    """This rank's part of one run (``LOCAL_RANK``); rank 0 writes the run's figures."""
    rank = int(os.environ["LOCAL_RANK"])
    log = LogLines()
    logging.getLogger("autoloader").addHandler(log)
    logging.getLogger("autoloader").setLevel(logging.INFO)
    pl.seed_everything(0, verbose=False)
    dataset = IndexedItems(LENGTH, args.latency)
    module, watch = Fit(), Watch()
    trainer = pl.Trainer(
        accelerator="cpu", devices=RANKS, strategy="ddp", max_epochs=args.epochs,
        callbacks=[watch], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    rendezvous(args.run_dir, rank)
    started = watch.started = time.perf_counter()
    loader = build_loader(args.one, dataset, args)
    watch.held = loader
    trainer.fit(module, train_dataloaders=loader)
    seconds = time.perf_counter() - started
    params = params_of(args.one, loader)
    everyone: list[Any] = [None] * RANKS
    dist.all_gather_object(everyone, {"seen": module.seen, "params": params})
    if isinstance(loader, autoloader.AutoLoader):
        loader.close()  # the chosen setting's persistent workers
    if rank != 0:
        return
    samples = sum(len(ids) for mine in everyone for ids in mine["seen"].values())
    row: dict[str, Any] = {
        "variant": args.one,
        "epochs": args.epochs,
        "seconds": seconds,
        "samples": samples,
        "samples_per_second": samples / seconds,
        "epoch_check": epochs_check([mine["seen"] for mine in everyone], args.epochs),
        "params": params,
        "ranks_agree": all(mine["params"] == params for mine in everyone),
        "threads": torch.get_num_threads(),
    }
    if isinstance(loader, autoloader.AutoLoader):
        result: autoloader.TuneResult | None = loader.result
        row.update(
            tuned=loader.tuned,
            tuning_seconds=watch.tuned_at,
            trials=len(loader.history),
            failures=loader.failures,
            last_batch_setting=watch.used,
            held_setting=watch.held_setting,
            switches=watch.switches,
            result_tuning_seconds=None if result is None else result.tuning_seconds,
            reused=any(m.startswith(("AutoLoader: reusing", "reusing")) for m in log.messages),
            log=log.messages,
        )
    (args.run_dir / RESULT).write_text(json.dumps(row, default=str))


# The parent: the runs, the rounds, the table -------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member, not ours to signal, is still there
        return True
    return True


def run_ranks(
    variant: str, args: argparse.Namespace, run_dir: Path, path: Path | None
) -> dict[str, Any]:
    """``variant``'s run: its two ranks started here, each in a session of its own
    (their workers with them), killed with their sessions past ``--child-timeout``, a
    failed rank's peer given a little time to fail too; rank 0's figures, or why none."""
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--one", base(variant)]
    command += ["--run-dir", str(run_dir), "--epochs", str(args.epochs)]
    command += ["--time-budget", str(args.time_budget), "--latency", str(args.latency)]
    if path is not None:
        command += ["--path", str(path)]
    # What Lightning's launcher sets for the ranks it starts (it starts none where
    # LOCAL_RANK is set: both are started here, outside the clock).
    shared = {
        **(revision_env(variant) or os.environ),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NODE_RANK": "0",
        "WORLD_SIZE": str(RANKS),
    }
    started = time.perf_counter()
    processes = []
    for rank in range(RANKS):
        env = {**shared, "LOCAL_RANK": str(rank)}
        with open(run_dir / f"rank{rank}.log", "w") as out:
            processes.append(
                subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
                )
            )
    deadline = time.monotonic() + args.child_timeout
    timed_out = False
    while None in (codes := [process.poll() for process in processes]):
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + 30.0)  # its peer, stuck in DDP
        if time.monotonic() > deadline:
            timed_out = True
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
            for process in processes:
                process.wait()
        time.sleep(0.1)
    # A session of a rank, empty once its workers are gone (they notice a dead parent
    # within 5 s; at a clean exit the rank stops them itself).
    left = []
    for process in processes:
        give_up = time.monotonic() + 10.0
        while group_alive(process.pid) and time.monotonic() < give_up:
            time.sleep(0.1)
        if group_alive(process.pid):
            left.append(process.pid)
            os.killpg(process.pid, signal.SIGKILL)
    process_seconds = time.perf_counter() - started
    codes = [process.returncode for process in processes]
    result = run_dir / RESULT
    if timed_out or any(codes) or not result.exists():
        why = f"timed out after {args.child_timeout:g} s" if timed_out else f"exit {codes}"
        tails = []
        for rank in range(RANKS):
            lines = (run_dir / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()
            tails.append(f"rank {rank}: " + " | ".join(lines[-3:]))
        return {"variant": variant, "error": f"{why}: {'; '.join(tails)}"[:600]}
    row: dict[str, Any] = json.loads(result.read_text())
    row["variant"] = variant
    row["process_seconds"] = process_seconds
    row["left_behind"] = left
    return row


def chosen(row: dict[str, Any]) -> str:
    """The setting a run trained with, in a few words."""
    params = row.get("params")
    if not params:
        return "not tuned by the end of training" if row.get("tuned") is False else "-"
    words: str = setting(params)
    if params.get("step_threads"):
        words += f", step on {params['step_threads']} thread(s)"
    if not row.get("ranks_agree", True):
        words += " (rank 1 differs)"
    if base(row["variant"]) == SECOND:
        words += " (reused)" if row.get("reused") else " (NOT reused: tuned again)"
    last = row.get("last_batch_setting")
    if last and setting(last) != setting(params):
        words += f"; last batch: {setting(last)}"
    return words


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's rounds: medians and ranges."""
    good = [row for row in rows if "error" not in row]
    if not good:
        return {}
    seconds = [row["seconds"] for row in good]
    tuning = [row["tuning_seconds"] for row in good if row.get("tuning_seconds") is not None]
    return {
        "seconds": statistics.median(seconds),
        "seconds_range": (min(seconds), max(seconds)),
        "samples_per_second": statistics.median(row["samples_per_second"] for row in good),
        "tuning_seconds": statistics.median(tuning) if tuning else None,
        "epoch_checks": sorted({row["epoch_check"] for row in good}),
        "left_behind": sum(len(row["left_behind"]) for row in good),
    }


def table(by_variant: dict[str, list[dict[str, Any]]]) -> str:
    """A row a variant, each against the best hand setting (highest median rate)."""
    figures = {variant: summary(rows) for variant, rows in by_variant.items()}
    hands = [v for v in figures if hand_workers(v) is not None and figures[v]]
    best = max(hands, key=lambda v: figures[v]["samples_per_second"]) if hands else None
    rounds = max(len(rows) for rows in by_variant.values())
    lines = [
        f"medians of {rounds} round(s); best hand setting: {best or 'none measured'}",
        "| variant | epochs | whole run s (min-max) | samples/s | / best hand | target "
        "| tuned after s | chosen | epochs check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, rows in by_variant.items():
        found = figures[variant]
        if not found:
            error = rows[0]["error"] if rows else "not run"
            lines.append(f"| {variant} | - | - | - | - | - | - | {error} | - |")
            continue
        ratio = found["samples_per_second"] / figures[best]["samples_per_second"] if best else None
        low, high = found["seconds_range"]
        tuning = found["tuning_seconds"]
        checks = ", ".join(found["epoch_checks"])
        if found["left_behind"]:
            checks += f"; {found['left_behind']} process(es) left behind"
        lines.append(
            f"| {variant} | {rows[0]['epochs']} | {found['seconds']:.1f} ({low:.1f}-{high:.1f}) "
            f"| {found['samples_per_second']:,.0f} | {'-' if ratio is None else f'{ratio:.3f}'} "
            f"| {f'>= {TARGET}' if base(variant) == FIRST else ''} "
            f"| {'-' if tuning is None else f'{tuning:.1f}'} "
            f"| {'; '.join(sorted({chosen(row) for row in rows if 'error' not in row}))} "
            f"| {checks} |"
        )
    for variant in (v for v in figures if base(v) == FIRST):
        first = figures[variant]
        if not (first and best):
            continue
        ratio = first["samples_per_second"] / figures[best]["samples_per_second"]
        met = "met" if ratio >= TARGET else "missed"
        lines.append(
            f"\n{variant}: {ratio:.3f} of the best hand setting's ({best}) "
            f"whole-run rate; target >= {TARGET}: {met}"
        )
    return "\n".join(lines)


def say(round_number: int, row: dict[str, Any]) -> None:
    """One run's line as it ends."""
    if "error" in row:
        print(f"  round {round_number + 1} {row['variant']:<22} error: {row['error']}", flush=True)
        return
    tuning = row.get("tuning_seconds")
    print(
        f"  round {round_number + 1} {row['variant']:<22} {row['seconds']:6.1f} s "
        f"({row['process_seconds']:.1f} s in all), {row['samples_per_second']:6,.0f} samples/s, "
        f"{chosen(row)}"
        + (f", tuned after {tuning:.1f} s" if tuning is not None else "")
        + f"; epochs {row['epoch_check']}"
        + (f"; LEFT BEHIND: pids {row['left_behind']}" if row["left_behind"] else ""),
        flush=True,
    )
    if "trials" in row:
        print(
            f"      {row['trials']} trials, {row['switches']} setting(s) seen loading "
            f"batches; the built loader's .setting at the last batch: {row['held_setting']}",
            flush=True,
        )
    for failure in row.get("failures") or []:
        print(f"      failure: {failure}", flush=True)
    for line in row.get("log", []):
        print(f"      {line}", flush=True)


def rotation(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """The rotation's units: the second AutoLoader run reads the file the first writes."""
    chosen_kinds = set(args.variants.split(","))
    unknown = chosen_kinds - {"defaults", "hand", "first", "second"}
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; from defaults,hand,first,second")
    found: list[tuple[str, ...]] = []
    if "defaults" in chosen_kinds:
        found.append((DEFAULTS,))
    if "hand" in chosen_kinds:
        found += [(hand(int(w)),) for w in args.hand.split(",") if w]
    autoloaders = tuple(
        v for kind, v in (("first", FIRST), ("second", SECOND)) if kind in chosen_kinds
    )
    if autoloaders:
        found.append(autoloaders)
        if args.before:  # the same runs with the autoloader of revision --before
            found.append(tuple(f"{v} @{args.before}" for v in autoloaders))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=10.0)
    parser.add_argument(
        "--epochs", type=int, default=0, help="0: 3x the time budget of the best hand's epochs"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hand", default="2,4,8", help="num_workers of the hand settings")
    parser.add_argument("--latency", type=float, default=0.003, help="seconds an item waits")
    parser.add_argument(
        "--variants",
        default="defaults,hand,first,second",
        help="which to run, of defaults,hand,first,second (second alone: it tunes)",
    )
    parser.add_argument(
        "--before",
        default=None,
        help="a git revision whose AutoLoader runs too, side by side (benchmarks/revisions.py)",
    )
    parser.add_argument("--child-timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=None)
    # One rank of one run (the parent starts these).
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.epochs = args.epochs or round(3 * args.time_budget / BEST_EPOCH_SECONDS)
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and log intervals
    if args.one:
        one_rank(args)
        return
    units = rotation(args)
    print(
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, lightning {version('lightning')}; "
        f"{RANKS} ranks x {BATCHES_PER_RANK} batches of {BATCH_SIZE} an epoch "
        f"({LENGTH} items, {args.latency * 1e3:g} ms each), {args.epochs} epochs; "
        f"time budget {args.time_budget:g} s; {args.rounds} round(s)",
        flush=True,
    )
    by_variant: dict[str, list[dict[str, Any]]] = {v: [] for unit in units for v in unit}
    for round_number in range(args.rounds):
        shift = round_number % len(units)
        folder = Path(tempfile.mkdtemp(prefix="ddp-short-epochs-"))
        try:
            for unit in units[shift:] + units[:shift]:
                for variant in unit:
                    file = "autoloader.json" if variant == base(variant) else "before.json"
                    path = folder / file if base(variant) in (FIRST, SECOND) else None
                    run_dir = folder / variant.replace(" ", "-")
                    row = run_ranks(variant, args, run_dir, path)
                    by_variant[variant].append(row)
                    say(round_number, row)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print("\n" + table(by_variant), flush=True)
    if args.json:
        args.json.write_text(json.dumps(by_variant, indent=2, default=str))


if __name__ == "__main__":
    main()

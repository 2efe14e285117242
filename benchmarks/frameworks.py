"""Training time in the frameworks: Lightning's ``Trainer.fit`` and the HF ``Trainer``,
untuned, with Lightning's suggested worker count, and tuned by autoloader's adapters.

A latency-bound dataset (each item waits ``--latency`` seconds, a read from remote
storage; batches of 32), a small model trained on the CPU. Each framework trains
``--steps`` optimizer steps with:

- ``defaults``: the loader as users write it (``num_workers=0``);
- ``suggested``: the count Lightning's warning suggests, ``max(1, cpus // local ranks
  - 1)`` (``lightning.fabric.utilities.data.suggested_max_num_workers``);
- ``tuned``: the adapter's settings (``LoaderTuner`` / ``tune_trainer``), tuned once
  before the rounds (the tuning time is shown apart) and reused from its file in each
  round, as a second run of the same training would.

The rounds are interleaved (defaults, suggested, tuned, then again), each timed from
the start of training to its end, worker start-up included; the median of the rounds
is shown, and ratios against the defaults.

    python benchmarks/frameworks.py [--framework lightning|transformers|both] [--steps 60]
        [--rounds 3] [--time-budget 30] [--latency 0.003]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import autoloader

BATCH_SIZE = 32
WIDTH = 64


class RemoteItems(Dataset[dict[str, torch.Tensor]]):
    """Items that wait ``latency`` seconds each; deterministic values."""

    def __init__(self, length: int, latency: float) -> None:
        self.length, self.latency = length, latency

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.latency)
        x = torch.linspace(-1, 1, WIDTH) * ((index % 13) / 13)
        return {"x": x, "y": x.mean(dim=0, keepdim=True)}


class Regressor(torch.nn.Module):
    """A small MLP; returns its loss as HF models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


def suggested_workers() -> int:
    from lightning.fabric.utilities.data import suggested_max_num_workers

    return suggested_max_num_workers(1)


# --- Lightning ------------------------------------------------------------------------


def lightning_run(
    dataset: RemoteItems, steps: int, num_workers: int | None, path: Path
) -> tuple[float, float | None]:
    """Training seconds of ``steps`` steps, and tuning seconds (``None`` when the run
    did not tune): ``num_workers`` set by hand, or ``None`` for LoaderTuner."""
    import lightning.pytorch as pl

    from autoloader.lightning import LoaderTuner

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Regressor()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(
                dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=num_workers or 0
            )

    class Timer(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.started = time.perf_counter()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.seconds = time.perf_counter() - self.started

    timer = Timer()
    tuner = LoaderTuner(time_budget=ARGS.time_budget, path=path, show_progress=False)
    callbacks: list[Any] = [timer] if num_workers is not None else [tuner, timer]
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    started = time.perf_counter()
    trainer.fit(Module())
    tuning = None
    if tuner.result is not None and tuner.result.tuning_seconds > 0:
        tuning = time.perf_counter() - started - timer.seconds
    return timer.seconds, tuning


# --- HF transformers ------------------------------------------------------------------


def transformers_run(
    dataset: RemoteItems, steps: int, num_workers: int | None, path: Path
) -> tuple[float, float | None]:
    """As :func:`lightning_run`, with the HF Trainer and ``tune_trainer``."""
    import transformers

    from autoloader.transformers import tune_trainer

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            self.seconds = time.perf_counter() - self.started

    timer = Timer()
    with tempfile.TemporaryDirectory() as out:
        arguments = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH_SIZE,
            dataloader_num_workers=num_workers or 0, report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True, use_cpu=True,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=Regressor(), args=arguments, train_dataset=dataset, callbacks=[timer]
        )
        trainer.remove_callback(transformers.PrinterCallback)  # its metrics on stdout
        tuning = None
        if num_workers is None:
            started, saved = time.perf_counter(), path.exists()
            tune_trainer(trainer, time_budget=ARGS.time_budget, path=path, show_progress=False)
            if not saved:
                tuning = time.perf_counter() - started
        trainer.train()
    return timer.seconds, tuning


# --- the table ------------------------------------------------------------------------

RUNS: dict[str, Callable[[RemoteItems, int, int | None, Path], tuple[float, float | None]]] = {
    "lightning": lightning_run,
    "transformers": transformers_run,
}


def bench(name: str, args: argparse.Namespace) -> None:
    run = RUNS[name]
    dataset = RemoteItems(BATCH_SIZE * (args.steps + 8), args.latency)
    suggested = suggested_workers()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.json"
        _, tuning = run(dataset, args.steps, None, path)  # tunes, saves
        result = autoloader.load(path)
        seconds: dict[str, list[float]] = {"defaults": [], "suggested": [], "tuned": []}
        for _ in range(args.rounds):
            seconds["defaults"].append(run(dataset, args.steps, 0, path)[0])
            seconds["suggested"].append(run(dataset, args.steps, suggested, path)[0])
            seconds["tuned"].append(run(dataset, args.steps, None, path)[0])
    median = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"\n{name}: {args.steps} steps of batch {BATCH_SIZE}, {args.latency * 1e3:.1f} ms per "
          f"item, {os.cpu_count()} CPUs, median of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"tuned settings: {result.params}")
    print(f"tuning: {tuning:.1f} s (budget {args.time_budget:.0f} s)" if tuning else "tuning: -")
    print(f"{'loader':<34}{'training s':>11}{'rounds':>24}{'vs defaults':>13}")
    labels = {
        "defaults": "defaults (num_workers=0)",
        "suggested": f"Lightning's suggestion ({suggested} worker{'s' * (suggested > 1)})",
        "tuned": "tuned",
    }
    for key, label in labels.items():
        rounds = ", ".join(f"{s:.2f}" for s in seconds[key])
        ratio = median["defaults"] / median[key]
        print(f"{label:<34}{median[key]:>11.2f}{rounds:>24}{ratio:>12.2f}x")
    if tuning:
        total = tuning + median["tuned"]
        print(f"{'tuning + tuned training':<34}{total:>11.2f}{'':>24}"
              f"{median['defaults'] / total:>12.2f}x")  # fmt: skip
        saved = (median["defaults"] - median["tuned"]) / args.steps
        if saved > 0:
            print(f"tuning pays for itself after {tuning / saved:,.0f} steps "
                  f"({saved * 1e3:.0f} ms saved per step)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=[*RUNS, "both"], default="both")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--latency", type=float, default=0.003)
    global ARGS
    ARGS = parser.parse_args()
    logging.disable(logging.WARNING)  # the frameworks' banners
    warnings.filterwarnings("ignore")
    for name in RUNS if ARGS.framework == "both" else [ARGS.framework]:
        bench(name, ARGS)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()

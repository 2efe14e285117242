"""A Lightning fit that tunes its own train dataloader first: ``LoaderTuner``.

The datamodule reads items that each wait 3 ms (a read from remote storage) and its
``train_dataloader()`` says nothing of workers, as most do. The callback tunes that
loader with the model's real training step when the fit starts, then the fit trains
with the tuned loader. A second run with the same ``--out`` file reuses the settings,
once a short trial agrees, and searches nothing.

    python examples/lightning_fit.py [--time-budget 30] [--epochs 2] [--out lightning.json]

Needs ``pip install 'torch-autoloader[lightning]'``.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import autoloader
from autoloader.lightning import LoaderTuner

ITEM_LATENCY = 0.003


class RemoteItems(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(ITEM_LATENCY)
        x = torch.linspace(-1, 1, 32) * (index % 11)
        return x, x.mean(dim=0, keepdim=True)


class Items(pl.LightningDataModule):
    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(RemoteItems(self.length), batch_size=32, shuffle=True)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class EpochTimer(pl.Callback):
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = time.perf_counter() - self.started
        print(f"epoch {trainer.current_epoch}: {seconds:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--items", type=int, default=2048)
    parser.add_argument("--out", default="lightning.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("lightning", "lightning.pytorch"):  # their banner, not ours
        logging.getLogger(name).setLevel(logging.WARNING)

    pl.seed_everything(0, verbose=False)
    tuner = LoaderTuner(time_budget=args.time_budget, path=args.out)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        callbacks=[tuner, EpochTimer()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Model(), datamodule=Items(args.items))
    assert tuner.result is not None
    print(autoloader.report(tuner.result))
    print(f"the fit trained with num_workers={trainer.train_dataloader.num_workers}")


if __name__ == "__main__":
    main()

"""The Lightning modules, callbacks and trainers of the Lightning tests.

Imported by a test when it runs (``tests.lazy.LazyModule``), and by the scripts of the
DDP tests in their processes: not by the test modules at collection, so that a
pytest-xdist worker that runs no Lightning test never imports Lightning.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from torch.utils.data import DataLoader

from autoloader import AutoLoader
from tests.test_autoloader_lightning import LENGTH, VALIDATION, IndexedItems
from tests.test_lightning import SlowItems
from tests.test_loader_state import _ids


class Regression(pl.LightningModule):
    """Dropout (the RNG matters), momentum (the optimizer's state matters), a scheduler
    and logging: everything a tuning step touches."""

    def __init__(self, loader_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        self.loader_kwargs = loader_kwargs or {}
        # Its state is neither a parameter nor a buffer.
        self.mean_loss = torchmetrics.MeanMetric()
        self.epoch_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        self.mean_loss.update(loss)
        return loss

    def on_train_epoch_end(self) -> None:
        # Computed by hand, not logged as a Metric (which Lightning resets on its own).
        self.epoch_losses.append(float(self.mean_loss.compute()))
        self.mean_loss.reset()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)]

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(SlowItems(), batch_size=8, shuffle=True, **self.loader_kwargs)


class Seen(pl.LightningModule):
    """Records the items each epoch trains on, in their order; its train loader is
    ``loader`` (made outside any hook) or, if ``None``, made in the hook."""

    def __init__(self, loader: AutoLoader[Any] | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.loader = loader
        self.made: AutoLoader[Any] | None = None
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())
        return torch.nn.functional.mse_loss(self.net(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[2]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        if self.loader is not None:
            return self.loader
        self.made = slow_autoloader()
        return self.made


class Validated(Seen):
    """Seen, validated each epoch by an AutoLoader made in its hook, which records the
    items each epoch validates."""

    def __init__(self) -> None:
        super().__init__()
        self.validating: AutoLoader[Any] | None = None
        self.validated: dict[int, list[int]] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self.validated.setdefault(self.current_epoch, []).extend(batch[2].tolist())

    def val_dataloader(self) -> DataLoader[Any]:
        self.validating = AutoLoader(
            IndexedItems(length=VALIDATION, latency=0), batch_size=4, time_budget=2,
            verbose=False,
        )  # fmt: skip
        return self.validating


def slow_autoloader() -> AutoLoader[Any]:
    """Items that wait 6 ms: worker processes pay, even on a busy machine (at 3 ms, a
    worker setting measured 1.2-1.9x the defaults beside a busy loop, as close as a short
    trial's error; at 6 ms 2.2-3.2x)."""
    return AutoLoader(
        IndexedItems(length=LENGTH, latency=0.006), batch_size=4, shuffle=True, time_budget=4,
        verbose=False,
    )  # fmt: skip


class StopWhenTuned(pl.Callback):
    """Ends the fit after the epoch in which every rank's loader is tuned."""

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        tuned = trainer.strategy.reduce_boolean_decision(trainer.train_dataloader.tuned, all=True)
        if tuned:
            trainer.should_stop = True


def trainer(**kwargs: Any) -> pl.Trainer:
    """A quiet trainer on the CPU: no logger, checkpoint, progress bar or summary."""
    return pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip


class Recording(pl.LightningModule):
    """Trains on ``loader``, recording each batch's ids (``test_loader_state._ids``)."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.loader = loader
        self.seen: list[list[int]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(_ids(batch))
        time.sleep(0.003)
        loss: torch.Tensor = self.net(batch).pow(2).mean()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        return self.loader
